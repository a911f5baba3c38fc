// Where a rank finds its place (<loom/sdk/launch.hpp>): the variables of torchrun and loom launch,
// Slurm and Open MPI, read from a fake environment, and one clear error for a partial set.
#include <loom/sdk/launch.hpp>

#include <gtest/gtest.h>

#include <map>
#include <string>

namespace {

using loom::sdk::launch_environment;

loom::sdk::GetEnv fake(const std::map<std::string, std::string>& vars) {
  return [vars](const char* name) -> const char* {
    auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    launch_environment(fake(vars));
  } catch (const loom::sdk::Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(LaunchEnvironment, NoLauncherIsNothing) { EXPECT_FALSE(launch_environment(fake({{"PATH", "/bin"}})).has_value()); }

TEST(LaunchEnvironment, TorchrunAndLoomLaunch) {
  const auto e = launch_environment(fake({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"},
                                          {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29501"}}));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "torchrun");
  EXPECT_EQ(e->rank, 3);
  EXPECT_EQ(e->world_size, 4);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->master_addr, "node7");
  EXPECT_EQ(e->port, 29501);
  EXPECT_FALSE(e->agent_store);
  const auto elastic = launch_environment(fake({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"},
                                                {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                                {"TORCHELASTIC_RESTART_COUNT", "2"}}));
  ASSERT_TRUE(elastic);
  EXPECT_TRUE(elastic->agent_store);
  EXPECT_EQ(elastic->restart, 2);
}

TEST(LaunchEnvironment, SlurmTakesTheFirstHostOfTheNodeList) {
  const auto e = launch_environment(fake({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
                                          {"SLURM_JOB_NODELIST", "gpu[07-09,12],cpu3"}}));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "slurm");
  EXPECT_EQ(e->rank, 5);
  EXPECT_EQ(e->world_size, 8);
  EXPECT_EQ(e->local_rank, 1);
  EXPECT_EQ(e->master_addr, "gpu07");
  EXPECT_EQ(e->port, 29500);
  EXPECT_EQ(loom::sdk::first_slurm_host("a1,b2"), "a1");
  EXPECT_EQ(loom::sdk::first_slurm_host("node[001-004]"), "node001");
  EXPECT_EQ(loom::sdk::first_slurm_host("rack[2-3]-n[1-4]"), "rack2-n1");
  const auto given = launch_environment(fake({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                                              {"SLURM_JOB_NODELIST", "x[1-2]"}, {"MASTER_ADDR", "head"},
                                              {"MASTER_PORT", "1234"}}));
  EXPECT_EQ(given->master_addr, "head");
  EXPECT_EQ(given->port, 1234);
}

TEST(LaunchEnvironment, OpenMpiOnOneNodeUsesLoopback) {
  const auto e = launch_environment(fake({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
                                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}));
  ASSERT_TRUE(e);
  EXPECT_EQ(e->launcher, "mpi");
  EXPECT_EQ(e->master_addr, "127.0.0.1");
  EXPECT_NE(error_of({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}})
                .find("MASTER_ADDR is not set"),
            std::string::npos);
}

TEST(LaunchEnvironment, APartialOrAbsurdSetIsOneErrorNamingTheVariable) {
  EXPECT_NE(error_of({{"RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}).find("not WORLD_SIZE"), std::string::npos);
  EXPECT_NE(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})
                .find("RANK = '2' is outside 0 ... 1"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).find("MASTER_ADDR is not"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2x"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}})
                .find("WORLD_SIZE = '2x'"),
            std::string::npos);
  EXPECT_NE(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}})
                .find("MASTER_PORT = '70000'"),
            std::string::npos);
  EXPECT_NE(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"}}).find("SLURM_JOB_NODELIST"),
            std::string::npos);
}

}  // namespace
