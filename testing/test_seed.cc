#include "testing/test_seed.h"

#include <cstdio>
#include <cstdlib>
#include <random>

#include "absl/strings/numbers.h"

namespace optimd {

uint32_t TestSeed() {
  uint32_t seed;
  const char* env = std::getenv("OPTIMD_TEST_SEED");
  if (env != nullptr) {
    if (!absl::SimpleAtoi(env, &seed)) {
      std::fprintf(stderr,
                   "OPTIMD_TEST_SEED=%s is not a seed: give a whole number "
                   "from 0 to 4294967295\n",
                   env);
      std::abort();
    }
  } else {
    seed = std::random_device{}();
  }
  std::printf("seed %u\n", seed);
  std::fflush(stdout);
  return seed;
}

}  // namespace optimd
