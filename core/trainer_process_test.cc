#include "core/trainer_process.h"

#include <sys/wait.h>
#include <unistd.h>

#include "gtest/gtest.h"

namespace optimd {
namespace {

TEST(TrainerProcessTest, ThisProcessRunsAChildThatExitedIsGone) {
  auto self = FindTrainerProcess(static_cast<uint32_t>(getpid()));
  ASSERT_TRUE(self.has_value());
  EXPECT_GT(self->start_ticks, 0u);
  EXPECT_FALSE(TrainerGone(*self));
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    pause();
    _exit(0);
  }
  auto seen = FindTrainerProcess(static_cast<uint32_t>(child));
  ASSERT_TRUE(seen.has_value());
  EXPECT_FALSE(TrainerGone(*seen));
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_TRUE(TrainerGone(*seen));
  // A pid reused by a newer process is not the trainer.
  TrainerProcess older = *self;
  older.start_ticks -= 1;
  EXPECT_TRUE(TrainerGone(older));
  EXPECT_FALSE(FindTrainerProcess(0).has_value());
}

}  // namespace
}  // namespace optimd
