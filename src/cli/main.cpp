// `diffcp` command-line tool: one binary, one subcommand per job. Run MPI jobs under mpirun.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "cli/commands.hpp"
#include "cli/sim.hpp"
#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/core/error.hpp"
#include "diffcp/ops/backend.hpp"

int main(int argc, char** argv) {
  CLI::App app{"diffcp: communication-efficient parallel attention for diffusion models"};
  app.require_subcommand(1);
  // Global: allowed before or after the subcommand's name (fallthrough).
  app.fallthrough();
  double comm_timeout = 600;
  app.add_option("--comm-timeout", comm_timeout,
                 "seconds a collective or transfer may take before the watchdog aborts the whole job with a "
                 "message naming it and the ranks that had not arrived (0 = off)")
      ->envname("DIFFCP_COMM_TIMEOUT")
      ->check(CLI::Validator(
          [](std::string& v) -> std::string {
            char* end = nullptr;
            const double x = std::strtod(v.c_str(), &end);
            if (v.empty() || *end != '\0' || !std::isfinite(x) || x < 0)
              return "'" + v + "': expected a number of seconds >= 0 (0 = no watchdog)";
            return "";
          },
          "SECONDS"))
      ->capture_default_str();
  std::string backend = "cpu";
  app.add_option("--backend", backend,
                 "compute backend of every command that computes (`diffcp backends` lists them); on every rank")
      ->envname("DIFFCP_BACKEND")
      ->capture_default_str();
  std::string comm = "mpi";
  app.add_option("--comm", comm,
                 "communicator of every MPI command: mpi; rendezvous (NCCL's semantics made strict, on MPI: "
                 "synchronous sends, grouped transfers, one stream, no tags); or nccl (the GPUs, bootstrapped over "
                 "MPI: a CUDA build, one GPU per rank)")
      ->envname("DIFFCP_COMM")
      ->check(CLI::IsMember({"mpi", "rendezvous", "nccl"}))
      ->capture_default_str();
  diffcp::cli::AttnOptions attn;
  diffcp::cli::PlanOptions plan;
  diffcp::cli::TrainCommand train;
  diffcp::cli::BenchCpOptions bench_cp;
  diffcp::cli::BenchP2pOptions bench_p2p;
  diffcp::cli::BenchCollOptions bench_coll;
  diffcp::cli::ExportOptions export_opt;
  diffcp::cli::DraftOptions draft;
  diffcp::cli::add_attn_command(app, attn);
  diffcp::cli::add_plan_command(app, plan);
  diffcp::cli::add_train_command(app, train);
  diffcp::cli::add_dit_command(app);
  diffcp::cli::add_export_command(app, export_opt);
  diffcp::cli::add_draft_command(app, draft);
  diffcp::cli::add_bench_command(app, bench_cp, bench_p2p, bench_coll);
  diffcp::cli::add_sim_command(app);
  diffcp::cli::add_backends_command(app);
  // Parse before MPI starts so --help and usage errors need no MPI; every rank parses the same argv.
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const std::string command = app.get_subcommands().front()->get_name();
  const bool sim_model = app.got_subcommand("sim") && !diffcp::cli::sim_needs_mpi(app);
  if (app.got_subcommand("plan") || app.got_subcommand("export") || app.got_subcommand("backends") || sim_model) {  // no MPI
    try {
      if (app.got_subcommand("backends")) return diffcp::cli::run_backends(backend);
      diffcp::cli::select_backend(backend, command);
      if (sim_model) return diffcp::cli::run_sim(app);
      return app.got_subcommand("plan") ? diffcp::cli::run_plan(plan) : diffcp::cli::run_export(export_opt);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "diffcp: error: %s\n", diffcp::cli::cli_flags(e.what()).c_str());
      return 1;
    }
  }
  diffcp::Communicator::set_watchdog_timeout(comm_timeout);
  return diffcp::run_mpi_main(argc, argv, [&](diffcp::Communicator& mpi_world) {
    diffcp::cli::select_backend(backend, command);  // every rank: a refused name fails on all of them
    const std::unique_ptr<diffcp::Communicator> other_world = diffcp::make_world(comm);  // null: MPI
    diffcp::Communicator& world = other_world ? *other_world : mpi_world;
    const auto run_command = [&] {
      if (app.got_subcommand("attn")) return diffcp::cli::run_attn(world, attn);
      if (app.got_subcommand("train")) return diffcp::cli::run_train(world, train);
      if (app.got_subcommand("dit")) return diffcp::cli::run_dit(world);
      if (app.got_subcommand("draft")) return diffcp::cli::run_draft(world, draft);
      if (app.got_subcommand("bench") && app.get_subcommand("bench")->got_subcommand("cp"))
        return diffcp::cli::run_bench_cp(world, bench_cp);
      if (app.got_subcommand("bench") && app.get_subcommand("bench")->got_subcommand("p2p"))
        return diffcp::cli::run_bench_p2p(world, bench_p2p);
      if (app.got_subcommand("bench") && app.get_subcommand("bench")->got_subcommand("coll"))
        return diffcp::cli::run_bench_coll(world, bench_coll);
      if (app.got_subcommand("sim")) return diffcp::cli::run_sim_calibrate(world);
      return 1;
    };
    int rc = 0;
    try {
      rc = run_command();
    } catch (const diffcp::Error& e) {  // the library names its fields (`cache_ratio`); the CLI, its flags
      throw diffcp::Error(diffcp::cli::cli_flags(e.what()));
    }
    diffcp::active_backend().synchronize();  // the device has run (and reported) everything before exit
    return rc;
  });
}
