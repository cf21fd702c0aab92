// Replays the checkpoint fuzz corpus (core/testdata/checkpoint_corpus)
// through the fuzz target in the normal build (core/corpus_replay.h).
#include "core/checkpoint_fuzz.h"

#include "core/corpus_replay.h"

int main(int argc, char** argv) {
  optimd::CorpusReplay replay;
  replay.default_dir = "core/testdata/checkpoint_corpus";
  replay.min_valid = 2;
  replay.write_seeds = optimd::WriteFuzzSeeds;
  replay.run = optimd::LoadFuzzCheckpoint;
  return optimd::ReplayCorpusMain(argc, argv, replay);
}
