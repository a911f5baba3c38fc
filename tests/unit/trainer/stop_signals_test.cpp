// The second stop signal (Ctrl-C twice): the process ends at once, by that signal, and says where
// the run stands (it ended without a word): the command that continues it once a checkpoint was
// written, that nothing can be continued before. Each case runs in a child process of its own
// (a death test), the signals raised in it.
#include <loom/core/stop_signals.hpp>

#include <gtest/gtest.h>

#include <csignal>

#include <sys/wait.h>
#include <unistd.h>

namespace {

using loom::core::install_stop_signals;
using loom::core::note_checkpoint_written;
using loom::core::note_stop_at_once;

TEST(StopSignals, TheSecondSignalEndsTheProcessSayingWhereTheRunStands) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto twice = [](bool saved) {
    install_stop_signals();
    note_stop_at_once("\nloom: continue with: loom train --resume auto\n", "\nloom: nothing of it can be continued\n");
    if (saved) note_checkpoint_written();
    std::raise(SIGINT);  // the first: a graceful stop, said
    std::raise(SIGINT);  // the second: at once
    std::_Exit(0);       // (not reached)
  };
  EXPECT_EXIT(twice(false), testing::KilledBySignal(SIGINT),
              "stopping after the current step, with a checkpoint; send SIGINT or SIGTERM again to stop at once\n+"
              "loom: nothing of it can be continued");
  EXPECT_EXIT(twice(true), testing::KilledBySignal(SIGINT), "loom: continue with: loom train --resume auto");
}

TEST(StopSignals, ASigintFromAnotherSenderAMomentAfterIsTheSameStop) {
  // `pkill -INT loom` reaches a rank directly and through loom launch, a moment apart: the same
  // stop (the rank stopped at once, its checkpoint lost, probe). Twice from one sender (a user's
  // two Ctrl-C) is still the second (above).
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        install_stop_signals();
        std::raise(SIGINT);  // from this process
        if (const pid_t child = ::fork(); child == 0) {
          ::kill(::getppid(), SIGINT);  // from another
          ::_exit(0);
        } else {
          ::waitpid(child, nullptr, 0);
        }
        std::_Exit(0);
      },
      testing::ExitedWithCode(0), "stopping after the current step");
}

TEST(StopSignals, RanksButTheFirstOfLoomLaunchSayNothing) {
  // Under loom launch every rank's output is shown: the same lines came once per rank. (A rank
  // started otherwise, a node's own, is the one its user sees: it speaks.)
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        ::setenv("RANK", "1", 1);
        install_stop_signals();
        std::raise(SIGINT);
        std::_Exit(0);
      },
      testing::ExitedWithCode(0), "stopping after the current step");
  EXPECT_EXIT(
      {
        ::setenv("RANK", "1", 1);
        ::setenv("LOCAL_RANK", "1", 1);
        ::setenv("LOOM_LAUNCH_CHECKED", "1", 1);
        install_stop_signals();
        note_stop_at_once("\nloom: continue with: x\n", "\nloom: nothing of it\n");
        std::raise(SIGINT);
        std::raise(SIGINT);
        std::_Exit(0);
      },
      testing::KilledBySignal(SIGINT), "^$");
  // The first rank of another node (RANK 2, LOCAL_RANK 0) speaks: that node's launcher shows it
  // (every rank of a node but 0 was quiet, so a Ctrl-C there said nothing at all).
  EXPECT_EXIT(
      {
        ::setenv("RANK", "2", 1);
        ::setenv("LOCAL_RANK", "0", 1);
        ::setenv("LOOM_LAUNCH_CHECKED", "1", 1);
        install_stop_signals();
        std::raise(SIGINT);
        std::_Exit(0);
      },
      testing::ExitedWithCode(0), "stopping after the current step");
}

}  // namespace
