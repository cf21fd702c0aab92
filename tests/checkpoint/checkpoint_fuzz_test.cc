// Replays the checkpoint fuzz corpus
// (tests/checkpoint/testdata/checkpoint_corpus) through the fuzz target in the
// normal build (testing/corpus_replay.h).
#include "tests/checkpoint/checkpoint_fuzz.h"

#include "testing/corpus_replay.h"

int main(int argc, char** argv) {
  optimd::CorpusReplay replay;
  replay.default_dir = "tests/checkpoint/testdata/checkpoint_corpus";
  replay.min_valid = 2;
  replay.write_seeds = optimd::WriteFuzzSeeds;
  replay.run = optimd::LoadFuzzCheckpoint;
  return optimd::ReplayCorpusMain(argc, argv, replay);
}
