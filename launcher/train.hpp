// `moevement train CONFIG [--set key=value ...]`: one process, no actors. Trains, prints loss,
// validation loss and tokens per second, and ends with `state_hash=<16 hex>` on its own line.
#pragma once

namespace moevement::launcher {

int run_train(int argc, char** argv);

}  // namespace moevement::launcher
