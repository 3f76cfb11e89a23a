#include "transport/bulk.hpp"

namespace moevement::transport {

void write_descriptor(wire::BulkDescriptor::Builder b, const bulk_descriptor& d) {
  b.setNode(d.node);
  b.setRegion(d.region);
  b.setOffset(d.offset);
  b.setLength(d.length);
}

result<bulk_descriptor> read_descriptor(wire::BulkDescriptor::Reader r) {
  bulk_descriptor d{r.getNode(), r.getRegion(), r.getOffset(), r.getLength()};
  if (d.length == 0) return error{"bulk descriptor of zero length"};
  if (d.region == 0) return error{"bulk descriptor names region 0, which no node exports"};
  if (d.offset + d.length < d.offset) return error{"bulk descriptor range overflows"};
  return d;
}

}  // namespace moevement::transport
