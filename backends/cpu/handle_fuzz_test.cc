// Replays the handle fuzz corpus (backends/cpu/testdata/handle_corpus)
// through the fuzz target in the normal build (testing/corpus_replay.h).
#include "backends/cpu/handle_fuzz.h"

#include "testing/corpus_replay.h"

int main(int argc, char** argv) {
  optimd::CorpusReplay replay;
  replay.default_dir = "backends/cpu/testdata/handle_corpus";
  replay.min_valid = 6;
  replay.write_seeds = optimd::WriteHandleSeeds;
  replay.run = optimd::ApplyFuzzHandle;
  return optimd::ReplayCorpusMain(argc, argv, replay);
}
