// The communicator kinds by name (comm/mpi_runtime.hpp, comm/mpi_communicator.hpp). Its own
// translation unit: a program that only calls run_mpi_main links neither the rendezvous nor, in a
// CUDA build, the NCCL communicator (and CUDA with it).
#include "diffcp/comm/mpi_communicator.hpp"
#include "diffcp/comm/mpi_runtime.hpp"
#include "diffcp/comm/rendezvous_communicator.hpp"
#ifdef DIFFCP_HAVE_CUDA
#include "diffcp/comm/nccl_communicator.hpp"
#endif

namespace diffcp {

std::vector<std::string> comm_kinds() {
#ifdef DIFFCP_HAVE_CUDA
  return {"mpi", "rendezvous", "nccl"};
#else
  return {"mpi", "rendezvous"};
#endif
}

std::unique_ptr<Communicator> make_communicator(const std::string& kind, MPI_Comm comm, const std::string& name) {
  find_node_local(comm);  // before the NCCL communicator creates the CUDA backend (it picks its GPU by it)
  if (kind == "mpi") return std::make_unique<MpiCommunicator>(comm, name);
  if (kind == "rendezvous") return std::make_unique<RendezvousCommunicator>(comm, name);
#ifdef DIFFCP_HAVE_CUDA
  if (kind == "nccl") return std::make_unique<NcclCommunicator>(comm, name);
#else
  DIFFCP_CHECK(kind != "nccl", "communicator 'nccl': this build has no CUDA backend (configure with -DDIFFCP_CUDA=ON)");
#endif
  std::string choices;
  for (const std::string& k : comm_kinds()) choices += (choices.empty() ? "" : ", ") + k;
  DIFFCP_FAIL("communicator '", kind, "': expected one of ", choices);
}

std::unique_ptr<Communicator> make_world(const std::string& kind) {
  return kind == "mpi" ? nullptr : make_communicator(kind, MPI_COMM_WORLD, "world");
}

}  // namespace diffcp
