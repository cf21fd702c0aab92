// The seed of a randomized test: $OPTIMD_TEST_SEED when it is set (to
// replay a failure, as the Python tests take it), else a fresh one from
// std::random_device. Printed as "seed N" either way, so that any failing
// run names the seed that reproduces it.
//
// Thread-safe.
#ifndef OPTIMD_TESTING_TEST_SEED_H_
#define OPTIMD_TESTING_TEST_SEED_H_

#include <cstdint>

namespace optimd {

// Aborts with a message when $OPTIMD_TEST_SEED is set but not a number
// below 2^32: a typo must not silently run another seed.
uint32_t TestSeed();

}  // namespace optimd

#endif  // OPTIMD_TESTING_TEST_SEED_H_
