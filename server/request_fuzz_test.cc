// Replays the request fuzz corpus (server/testdata/request_corpus) through
// the fuzz target in the normal build (testing/corpus_replay.h).
#include "server/request_fuzz.h"

#include "testing/corpus_replay.h"

int main(int argc, char** argv) {
  optimd::CorpusReplay replay;
  replay.default_dir = "server/testdata/request_corpus";
  replay.min_valid = 9;
  replay.write_seeds = optimd::WriteRequestSeeds;
  replay.run = optimd::ApplyFuzzRequest;
  return optimd::ReplayCorpusMain(argc, argv, replay);
}
