// The memory tracker and the budget allocator: exact bytes, from the allocator.
#include "test_util.h"

namespace memfit {
namespace {

class MemoryTest : public ::testing::Test {
 protected:
  void SetUp() override { test::use_memfit_allocator(); }
};

TEST_F(MemoryTest, CountsExactTensorBytesAndPeak) {
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  EXPECT_EQ(tracker->current(test::cpu_counted()), 0);
  {
    auto a = torch::empty({1000}, torch::kFloat);   // 4000 bytes
    auto b = torch::empty({10, 10}, torch::kDouble);  // 800 bytes
    EXPECT_EQ(tracker->current(test::cpu_counted()), 4800);
  }
  EXPECT_EQ(tracker->current(test::cpu_counted()), 0);
  EXPECT_EQ(tracker->peak(test::cpu_counted()), 4800);
  tracker->reset_peak();
  EXPECT_EQ(tracker->peak(test::cpu_counted()), 0);
  auto c = torch::empty({3}, torch::kByte);
  EXPECT_EQ(tracker->peak(test::cpu_counted()), 3);
}

TEST_F(MemoryTest, IgnoresFreesOfTensorsMadeBeforeIt) {
  auto before = torch::empty({256});
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  before = at::Tensor();
  EXPECT_EQ(tracker->current(test::cpu_counted()), 0);
}

TEST_F(MemoryTest, SeesAllocationsMadeDuringBackwardAndPhasePeaks) {
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  auto w = torch::randn({64, 64}, torch::requires_grad());
  auto x = torch::randn({32, 64});
  tracker->start_recording();
  at::Tensor loss;
  {
    PhaseGuard forward(Phase::kForward);
    loss = torch::relu(x.matmul(w)).sum();
  }
  {
    PhaseGuard backward(Phase::kBackward);
    loss.backward();
  }
  tracker->stop_recording();
  int64_t backward_allocated = 0;
  for (const auto& e : tracker->events()) {
    if (e.phase == Phase::kBackward && e.delta > 0) backward_allocated += e.delta;
  }
  // At least the 64x64 float gradient of w is allocated in backward.
  EXPECT_GE(backward_allocated, 64 * 64 * 4);
  EXPECT_EQ(w.grad().storage().nbytes(), 64u * 64u * 4u);
  EXPECT_GT(tracker->phase_peak(Phase::kBackward, test::cpu_counted()), 0);
  EXPECT_GT(tracker->phase_peak(Phase::kForward, test::cpu_counted()), 0);
  EXPECT_GE(tracker->phase_time_ns(Phase::kForward), 0);
}

TEST_F(MemoryTest, TrackerIsPerThreadUntilInstalledThere) {
  auto tracker = std::make_shared<MemoryTracker>();
  {
    TrackerScope scope(tracker);
    std::thread other([] { auto t = torch::empty({1000}); });  // not installed there
    other.join();
    EXPECT_EQ(tracker->peak(test::cpu_counted()), 0);
    std::thread installed([tracker] {
      TrackerScope there(tracker);
      auto t = torch::empty({1000});
    });
    installed.join();
    EXPECT_EQ(tracker->peak(test::cpu_counted()), 4000);
  }
}

TEST_F(MemoryTest, BudgetAllocatorThrowsOutOfMemoryAndStaysUsable) {
  auto& alloc = BudgetAllocator::install();
  const int64_t base = alloc.allocated();
  {
    BudgetGuard budget(base + 1000000);
    auto fits = torch::empty({100000});  // 400 kB
    EXPECT_EQ(alloc.allocated(), base + 400000);
    EXPECT_THROW(torch::empty({200000}), c10::OutOfMemoryError);  // would need 800 kB more
    EXPECT_EQ(alloc.allocated(), base + 400000);
    try {
      auto x = torch::randn({100, 100}, torch::requires_grad());
      auto big = torch::empty({1000000});
      FAIL() << "expected an out-of-memory error";
    } catch (const c10::OutOfMemoryError& e) {
      EXPECT_NE(std::string(e.what()).find("out of memory"), std::string::npos);
    }
    EXPECT_EQ(alloc.allocated(), base + 400000);  // the failed attempt's tensors were freed
  }
  auto after = torch::empty({1000000});  // budget restored: fine again
  EXPECT_EQ(after.numel(), 1000000);
}

TEST_F(MemoryTest, BudgetAllocatorReportsToTracker) {
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  auto& alloc = BudgetAllocator::install();
  const int64_t before = alloc.allocated();
  auto t = torch::empty({12345}, torch::kFloat);
  EXPECT_EQ(tracker->current(test::cpu_counted()), 12345 * 4);
  EXPECT_EQ(alloc.allocated() - before, 12345 * 4);
}

TEST_F(MemoryTest, InjectedFailureHitsTheNthAllocation) {
  auto& alloc = BudgetAllocator::install();
  alloc.fail_allocation_after(2);
  auto first = torch::empty({10});
  EXPECT_THROW(torch::empty({10}), c10::OutOfMemoryError);
  auto third = torch::empty({10});  // armed once only
  EXPECT_EQ(third.numel(), 10);
}

TEST(SizeTest, ParsesAndRejects) {
  EXPECT_EQ(parse_size("512MiB"), 512LL << 20);
  EXPECT_EQ(parse_size("1.5GiB"), 3LL << 29);
  EXPECT_EQ(parse_size("800MB"), 800000000LL);
  EXPECT_EQ(parse_size("1e9"), 1000000000LL);
  EXPECT_EQ(parse_size("4096"), 4096);
  for (const char* bad : {"", "abc", "12XB", "-5MiB", "0", "1.5.2GiB", "MiB"}) {
    EXPECT_THROW(parse_size(bad), std::invalid_argument) << bad;
  }
  try {
    parse_size("lots");
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'lots'"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("512MiB"), std::string::npos);
  }
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(3LL << 29), "1.50 GiB");
}

}  // namespace
}  // namespace memfit
