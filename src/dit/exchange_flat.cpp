// Ulysses "Flat" (SPEC B.1): one Communicator::all_to_all on the flat group per exchange.
#include "diffcp/dit/exchange.hpp"

namespace diffcp {

namespace {

class FlatExchange final : public AttentionExchange {
 public:
  FlatExchange(Communicator& world, int L) : AttentionExchange(ExchangeMode::flat, world.rank(), world.size(), L), world_(world) {}

 private:
  // The bytes go to the L-1 other ranks of this rank's group (ranks [g L, (g+1) L)) and the P-L
  // ranks of other groups: the flat algorithm does not care, the link classes do.
  void all_to_all(const void* send, void* recv, std::size_t count) override {
    world_.all_to_all_async(send, recv, wire_count(static_cast<std::int64_t>(count)), wire())->wait();
    const std::uint64_t block = static_cast<std::uint64_t>(wire_bytes(static_cast<std::int64_t>(count)));
    stats_.bytes_intra += block * static_cast<std::uint64_t>(group_size() - 1);
    stats_.bytes_inter += block * static_cast<std::uint64_t>(size() - group_size());
    stats_.scale_bytes += wire_format().scale_share(block * static_cast<std::uint64_t>(size() - 1));
    if (count > 0) stats_.messages += static_cast<std::uint64_t>(size() - 1);
  }

  Communicator& world_;
};

}  // namespace

std::unique_ptr<AttentionExchange> make_flat_exchange(Communicator& world, int group_size) {
  return std::make_unique<FlatExchange>(world, group_size);
}

}  // namespace diffcp
