// The CUDA caching allocator model (measure/cuda_allocator_model.h): each rule on hand-worked
// cases, then properties on random seeded traces. No torch: this executable builds in seconds.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <unordered_map>
#include <vector>

#include "memfit/errors.h"
#include "memfit/measure/cuda_allocator_model.h"

namespace memfit {
namespace {

constexpr int64_t MiB = cuda_sizes::kMiB;
constexpr CudaAllocatorRules k2 = CudaAllocatorRules::k2;
constexpr CudaAllocatorRules k1_13 = CudaAllocatorRules::k1_13;

CudaAllocatorModelOptions options(CudaAllocatorRules rules, const std::string& conf = "", int64_t limit = 0) {
  CudaAllocatorModelOptions o;
  o.rules = rules;
  o.conf = parse_cuda_alloc_conf(conf, rules);
  o.limit_bytes = limit;
  return o;
}

// --- rounding and segment sizes ---

TEST(CudaRounding, To512BytesAtLeast) {
  const CudaAllocatorConf none;
  for (CudaAllocatorRules rules : {k1_13, k2}) {
    EXPECT_EQ(cuda_round_size(1, rules, none), 512);
    EXPECT_EQ(cuda_round_size(512, rules, none), 512);
    EXPECT_EQ(cuda_round_size(513, rules, none), 1024);
    EXPECT_EQ(cuda_round_size(5 * MiB + 1, rules, none), 5 * MiB + 512);
  }
}

TEST(CudaRounding, PowerOfTwoDivisions) {
  for (CudaAllocatorRules rules : {k1_13, k2}) {
    const CudaAllocatorConf four = parse_cuda_alloc_conf("roundup_power2_divisions:4", rules);
    // Between 4 and 8 MiB the steps are 4, 5, 6, 7 MiB.
    EXPECT_EQ(cuda_round_size(5 * MiB + 1, rules, four), 6 * MiB);
    EXPECT_EQ(cuda_round_size(5 * MiB, rules, four), 5 * MiB);
    EXPECT_EQ(cuda_round_size(4 * MiB, rules, four), 4 * MiB);  // a power of two stays
    // At most 512 x divisions bytes the 512 B rounding applies.
    EXPECT_EQ(cuda_round_size(1200, rules, four), 1536);
    EXPECT_EQ(cuda_round_size(2049, rules, four), 2560);  // 2048..4096 in steps of 512
  }
}

TEST(CudaRounding, BypassThresholdIn113) {
  const CudaAllocatorConf c = parse_cuda_alloc_conf("roundup_power2_divisions:4,roundup_bypass_threshold_mb:4", k1_13);
  EXPECT_EQ(cuda_round_size(3 * MiB + 1, k1_13, c), 3 * MiB + 512 * 1024);  // 2..4 MiB in steps of 512 KiB
  EXPECT_EQ(cuda_round_size(5 * MiB + 1, k1_13, c), 5 * MiB + 512);         // over 4 MiB: 512 B only
}

TEST(CudaRounding, DivisionsPerIntervalIn2x) {
  // The first entry covers the intervals below it; ">" the rest from the last entry named.
  const CudaAllocatorConf c = parse_cuda_alloc_conf("roundup_power2_divisions:[2:2,8:4,>:8]", k2);
  EXPECT_EQ(c.roundup_power2_divisions[0], 2);   // sizes under 2 MiB
  EXPECT_EQ(c.roundup_power2_divisions[1], 2);   // 2-4 MiB
  EXPECT_EQ(c.roundup_power2_divisions[2], 0);   // 4-8 MiB: not named
  EXPECT_EQ(c.roundup_power2_divisions[3], 8);   // 8-16 MiB: ">" starts at the last entry
  EXPECT_EQ(c.roundup_power2_divisions[15], 8);
  EXPECT_EQ(cuda_round_size(3 * MiB + 1, k2, c), 4 * MiB);          // 2 divisions: 2, 3 MiB... 4
  EXPECT_EQ(cuda_round_size(5 * MiB + 1, k2, c), 5 * MiB + 512);    // 0: 512 B
  EXPECT_EQ(cuda_round_size(9 * MiB + 1, k2, c), 10 * MiB);         // 8 divisions of 8..16 MiB
}

TEST(CudaSegments, SizesByRequest) {
  EXPECT_EQ(cuda_segment_size(512), 2 * MiB);
  EXPECT_EQ(cuda_segment_size(1 * MiB), 2 * MiB);
  EXPECT_EQ(cuda_segment_size(1 * MiB + 512), 20 * MiB);
  EXPECT_EQ(cuda_segment_size(10 * MiB - 512), 20 * MiB);
  EXPECT_EQ(cuda_segment_size(10 * MiB), 10 * MiB);
  EXPECT_EQ(cuda_segment_size(10 * MiB + 512), 12 * MiB);
}

// --- the configuration ---

TEST(CudaAllocConf, RejectsBadSettingsInOneLine) {
  const char* bad_2x[] = {"max_split_size_mb:10", "roundup_power2_divisions:3", "garbage_collection_threshold:1.5",
                          "expandable_segments:yes", "no_such_option:1", "max_split_size_mb", "backend:cudaMallocAsync",
                          "roundup_power2_divisions:[3:2]", "roundup_power2_divisions:[2:2", "max_split_size_mb:-5"};
  for (const char* text : bad_2x) {
    try {
      parse_cuda_alloc_conf(text, k2);
      ADD_FAILURE() << "accepted: " << text;
    } catch (const OptionError& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
      EXPECT_NE(message.find(text), std::string::npos) << message;
      EXPECT_NE(message.find("accepts"), std::string::npos) << message;
    }
  }
  // 2.x-only options are refused under 1.13's rules, and 1.13's strict max_split_size_mb bound.
  EXPECT_THROW(parse_cuda_alloc_conf("expandable_segments:True", k1_13), OptionError);
  EXPECT_THROW(parse_cuda_alloc_conf("max_split_size_mb:20", k1_13), OptionError);
  EXPECT_THROW(parse_cuda_alloc_conf("roundup_bypass_threshold_mb:4", k2), OptionError);
}

TEST(CudaAllocConf, ReadsEveryOption) {
  const CudaAllocatorConf c = parse_cuda_alloc_conf(
      " max_split_size_mb:20, garbage_collection_threshold:0.6,expandable_segments:True,"
      "max_non_split_rounding_mb:40,backend:native,release_lock_on_cudamalloc:True",
      k2);
  EXPECT_EQ(c.max_split_size, 20 * MiB);
  EXPECT_DOUBLE_EQ(c.garbage_collection_threshold, 0.6);
  EXPECT_TRUE(c.expandable_segments);
  EXPECT_EQ(c.max_non_split_rounding, 40 * MiB);
  EXPECT_EQ(parse_cuda_alloc_conf("max_split_size_mb:21", k1_13).max_split_size, 21 * MiB);
  EXPECT_EQ(parse_cuda_alloc_conf("", k2).max_split_size, cuda_sizes::kNoLimit);
}

// --- pools, splitting, best fit ---

TEST(CudaModel, SmallRequestsShareA2MiBSegment) {
  CudaAllocatorModel m(options(k2));
  const int64_t a = m.malloc(1000), b = m.malloc(1000);
  EXPECT_EQ(m.reserved(), 2 * MiB);
  EXPECT_EQ(m.allocated(), 2048);
  EXPECT_EQ(m.segments(), 1);
  EXPECT_EQ(m.block_address(b), m.block_address(a) + 1024);  // split: b follows a
  m.free(a);
  m.free(b);
  EXPECT_EQ(m.allocated(), 0);
  EXPECT_EQ(m.reserved(), 2 * MiB);  // cached
  m.empty_cache();
  EXPECT_EQ(m.reserved(), 0);
  EXPECT_EQ(m.segments(), 0);
}

TEST(CudaModel, RequestsUnder10MiBShareA20MiBSegment) {
  CudaAllocatorModel m(options(k2));
  const int64_t a = m.malloc(3 * MiB), b = m.malloc(5 * MiB);
  EXPECT_EQ(m.reserved(), 20 * MiB);
  EXPECT_EQ(m.block_address(b), m.block_address(a) + 3 * MiB);
  EXPECT_EQ(m.allocated(), 8 * MiB);
  m.malloc(13 * MiB);  // 12 MiB remain cached; 10 MiB and more: a segment of its own, rounded to 2 MiB
  EXPECT_EQ(m.reserved(), 34 * MiB);
}

TEST(CudaModel, LargeBlocksSplitOnlyWhenMoreThan1MiBRemains) {
  CudaAllocatorModel m(options(k2));
  m.malloc(9 * MiB);                          // 20 MiB segment, 11 MiB cached
  const int64_t whole = m.malloc(10 * MiB);   // 1 MiB would remain: not split
  EXPECT_EQ(m.block_size(whole), 11 * MiB);
  EXPECT_EQ(m.allocated(), 20 * MiB);

  CudaAllocatorModel n(options(k2));
  n.malloc(9 * MiB);
  const int64_t split = n.malloc(10 * MiB - 512);  // 1 MiB + 512 remains: split
  EXPECT_EQ(n.block_size(split), 10 * MiB - 512);
  EXPECT_EQ(n.reserved(), 20 * MiB);
}

TEST(CudaModel, SmallBlocksSplitDownTo512Bytes) {
  CudaAllocatorModel m(options(k1_13));
  const int64_t b = m.malloc(1 * MiB), c = m.malloc(1 * MiB - 512), d = m.malloc(512);
  EXPECT_EQ(m.reserved(), 2 * MiB);  // 1 MiB + (1 MiB - 512) + 512 fill one segment exactly
  EXPECT_EQ(m.block_address(d), m.block_address(c) + 1 * MiB - 512);
  EXPECT_EQ(m.block_address(c), m.block_address(b) + 1 * MiB);
}

TEST(CudaModel, BestFitTakesTheSmallestCachedBlock) {
  CudaAllocatorModel m(options(k2));
  const int64_t big = m.malloc(14 * MiB), small = m.malloc(12 * MiB);
  const int64_t big_at = m.block_address(big), small_at = m.block_address(small);
  m.free(big);
  m.free(small);
  const int64_t a = m.malloc(11 * MiB);  // both fit: the 12 MiB one is taken, whole (1 MiB would remain)
  EXPECT_EQ(m.block_address(a), small_at);
  EXPECT_EQ(m.block_size(a), 12 * MiB);
  const int64_t b = m.malloc(13 * MiB);
  EXPECT_EQ(m.block_address(b), big_at);
  EXPECT_EQ(m.reserved(), 26 * MiB);
  EXPECT_EQ(m.segments(), 2);
}

TEST(CudaModel, FreedNeighboursMergeIntoOneBlock) {
  CudaAllocatorModel m(options(k2));
  const int64_t a = m.malloc(3 * MiB), b = m.malloc(4 * MiB), c = m.malloc(5 * MiB);
  m.free(a);
  m.free(c);
  m.free(b);  // a, b, c and the 8 MiB rest are one free 20 MiB block again
  m.malloc(19 * MiB);
  EXPECT_EQ(m.reserved(), 20 * MiB);
  m.empty_cache();  // the segment is in use: nothing to free
  EXPECT_EQ(m.reserved(), 20 * MiB);
}

TEST(CudaModel, StreamsDoNotShareCachedBlocks) {
  CudaAllocatorModel m(options(k2));
  m.free(m.malloc(1000, /*stream=*/0));
  m.malloc(1000, /*stream=*/1);
  EXPECT_EQ(m.reserved(), 4 * MiB);
  EXPECT_EQ(m.segments(), 2);
  m.malloc(1000, /*stream=*/0);  // stream 0's cached block
  EXPECT_EQ(m.reserved(), 4 * MiB);
}

// --- oversize blocks (max_split_size_mb) ---

TEST(CudaModel, OversizeBlocksServeOnlyLargeRequestsAndNeverSplit) {
  CudaAllocatorModel m(options(k2, "max_split_size_mb:40"));
  m.free(m.malloc(50 * MiB));
  m.malloc(30 * MiB);  // under max_split_size: the cached 50 MiB block may not serve it
  EXPECT_EQ(m.reserved(), 80 * MiB);
  const int64_t b = m.malloc(45 * MiB);  // 50 < 45 + 20: served whole, not split
  EXPECT_EQ(m.block_size(b), 50 * MiB);
  EXPECT_EQ(m.reserved(), 80 * MiB);
  m.free(b);
  m.malloc(42 * MiB - 512);  // 50 < 42 MiB - 512 + 20 MiB: reused
  EXPECT_EQ(m.reserved(), 80 * MiB);

  CudaAllocatorModel n(options(k2, "max_split_size_mb:40"));
  n.free(n.malloc(80 * MiB));
  n.malloc(50 * MiB);  // 80 >= 50 + 20: too wasteful, a new segment
  EXPECT_EQ(n.reserved(), 130 * MiB);
}

TEST(CudaModel, OversizeCachedBlocksAreFreedBeforeGivingUp) {
  CudaAllocatorModel m(options(k2, "max_split_size_mb:40", /*limit=*/100 * MiB));
  m.free(m.malloc(60 * MiB));
  m.malloc(30 * MiB);
  EXPECT_EQ(m.reserved(), 90 * MiB);
  m.malloc(25 * MiB);  // 26 MiB more passes the limit: the cached 60 MiB block goes first
  EXPECT_EQ(m.reserved(), 56 * MiB);
  EXPECT_EQ(m.num_alloc_retries(), 0);
  EXPECT_EQ(m.num_ooms(), 0);
}

// --- the memory fraction: retries and out of memory ---

TEST(CudaModel, AtTheLimitTheCacheIsFreedAndTheAllocationRetried) {
  CudaAllocatorModel m(options(k1_13, "", /*limit=*/40 * MiB));
  m.free(m.malloc(12 * MiB));
  EXPECT_GT(m.malloc(30 * MiB), 0);  // 12 + 30 > 40: the cached 12 MiB segment is freed, then it fits
  EXPECT_EQ(m.num_alloc_retries(), 1);
  EXPECT_EQ(m.reserved(), 30 * MiB);
  EXPECT_EQ(m.malloc(20 * MiB), 0);  // cannot fit at all
  EXPECT_EQ(m.num_ooms(), 1);
  EXPECT_EQ(m.num_alloc_retries(), 2);
  EXPECT_EQ(m.reserved(), 30 * MiB);
}

TEST(CudaModel, GarbageCollectionFreesTheLongestUnusedBlocks) {
  // With a limit of 100 MiB and a threshold of 0.5, a new segment past 50 MiB reserved first
  // frees cached blocks at least as old as the average (age: free-block searches since cached).
  CudaAllocatorModel m(options(k2, "garbage_collection_threshold:0.5", /*limit=*/100 * MiB));
  m.free(m.malloc(30 * MiB));  // A, cached early
  m.free(m.malloc(32 * MiB));  // B: 30 MiB was too small
  m.free(m.malloc(31 * MiB));  // reuses B (cached again, younger than A)
  EXPECT_EQ(m.reserved(), 62 * MiB);
  m.malloc(40 * MiB);  // 62 > 50: A (age 3 >= average 2) is freed, B (age 1) stays
  EXPECT_EQ(m.reserved(), 72 * MiB);
  m.malloc(31 * MiB);  // B still cached
  EXPECT_EQ(m.reserved(), 72 * MiB);
  EXPECT_EQ(m.num_alloc_retries(), 0);
}

// --- expandable segments (2.x) ---

TEST(CudaModel, ExpandableSegmentsGrowInPagesAtTheLowestFreeAddress) {
  CudaAllocatorModel m(options(k2, "expandable_segments:True"));
  const int64_t a = m.malloc(3 * MiB);
  EXPECT_EQ(m.reserved(), 20 * MiB);  // one 20 MiB page of the large pool
  const int64_t b = m.malloc(30 * MiB);  // 17 MiB free after a + one more page
  EXPECT_EQ(m.reserved(), 40 * MiB);
  EXPECT_EQ(m.block_address(b), m.block_address(a) + 3 * MiB);
  EXPECT_EQ(m.segments(), 1);
  m.malloc(19 * MiB);  // the 7 MiB left after b + a third page; 8 MiB stay free
  EXPECT_EQ(m.reserved(), 60 * MiB);
  const int64_t d = m.malloc(8 * MiB - 512 * 1024);  // split though only 512 KiB remain
  EXPECT_EQ(m.block_size(d), 8 * MiB - 512 * 1024);
  m.malloc(1000);  // the small pool's own segment, in 2 MiB pages
  EXPECT_EQ(m.reserved(), 62 * MiB);

  CudaAllocatorModel fixed(options(k2));
  fixed.malloc(3 * MiB);
  fixed.malloc(30 * MiB);
  EXPECT_EQ(fixed.reserved(), 50 * MiB);  // without: a 20 MiB and a 30 MiB segment
}

TEST(CudaModel, EmptyCacheUnmapsFreePagesOfExpandableSegments) {
  CudaAllocatorModel m(options(k2, "expandable_segments:True"));
  const int64_t a = m.malloc(30 * MiB), b = m.malloc(30 * MiB);
  EXPECT_EQ(m.reserved(), 60 * MiB);
  m.free(a);
  m.empty_cache();  // a's whole page (0-20 MiB) goes; 20-30 MiB shares a page with b
  EXPECT_EQ(m.reserved(), 40 * MiB);
  m.free(b);
  m.empty_cache();
  EXPECT_EQ(m.reserved(), 0);
  EXPECT_EQ(m.segments(), 0);
}

// --- properties on random traces ---

struct RandomTrace {
  std::vector<AllocationEvent> events;
};

// Allocations of 1 B to 64 MiB (log-uniform), freed at random; `frees` in [0, 1].
RandomTrace random_trace(uint32_t seed, int n, double frees) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> log_size(0, 26), coin(0, 1);
  RandomTrace t;
  std::vector<const void*> live;
  for (int i = 1; i <= n; ++i) {
    if (!live.empty() && coin(rng) < frees) {
      const size_t k = std::uniform_int_distribution<size_t>(0, live.size() - 1)(rng);
      t.events.push_back({live[k], -1});
      live.erase(live.begin() + static_cast<long>(k));
    } else {
      const void* ptr = reinterpret_cast<const void*>(static_cast<uintptr_t>(i) * 64);
      t.events.push_back({ptr, static_cast<int64_t>(std::exp2(log_size(rng))), static_cast<int>(coin(rng) < 0.1)});
      live.push_back(ptr);
    }
  }
  return t;
}

const char* const kConfs2x[] = {"", "max_split_size_mb:64", "roundup_power2_divisions:4", "expandable_segments:True",
                                "roundup_power2_divisions:[1:2,64:8,>:4],max_split_size_mb:32"};

TEST(CudaModelProperties, ReservedCoversAllocatedAtEveryEvent) {
  for (uint32_t seed = 1; seed <= 8; ++seed) {
    for (const char* conf : kConfs2x) {
      CudaAllocatorModel m(options(k2, conf));
      std::unordered_map<const void*, std::pair<int64_t, int64_t>> live;  // ptr -> (id, requested bytes)
      int64_t requested = 0;
      for (const AllocationEvent& e : random_trace(seed, 400, 0.45).events) {
        if (e.delta > 0) {
          live[e.ptr] = {m.malloc(e.delta, e.stream), e.delta};
          requested += e.delta;
        } else {
          m.free(live[e.ptr].first);
          requested -= live[e.ptr].second;
          live.erase(e.ptr);
        }
        ASSERT_GE(m.reserved(), m.allocated()) << "seed " << seed << " conf " << conf;
        ASSERT_GE(m.allocated(), requested);
        ASSERT_EQ(m.reserved() % (2 * MiB), 0);  // segments and pages are 2 MiB multiples
      }
    }
  }
}

TEST(CudaModelProperties, FreeingEverythingAndEmptyingTheCacheReturnsToZero) {
  for (uint32_t seed = 11; seed <= 16; ++seed) {
    for (CudaAllocatorRules rules : {k1_13, k2}) {
      for (const char* conf : {"", "max_split_size_mb:64", "expandable_segments:True", "garbage_collection_threshold:0.7"}) {
        if (rules == k1_13 && std::string(conf) == "expandable_segments:True") continue;
        CudaAllocatorModel m(options(rules, conf, /*limit=*/std::string(conf).rfind("garbage", 0) == 0 ? 2048 * MiB : 0));
        std::vector<AllocationEvent> events = random_trace(seed, 300, 0.4).events;
        std::unordered_map<const void*, int64_t> ids;
        for (const AllocationEvent& e : events) {
          if (e.delta > 0) {
            ids[e.ptr] = m.malloc(e.delta, e.stream);
          } else {
            if (ids.at(e.ptr) > 0) m.free(ids.at(e.ptr));
            ids.erase(e.ptr);
          }
        }
        for (const auto& [ptr, id] : ids) if (id > 0) m.free(id);
        EXPECT_EQ(m.allocated(), 0);
        m.empty_cache();
        EXPECT_EQ(m.reserved(), 0) << "seed " << seed << " conf " << conf;
        EXPECT_EQ(m.segments(), 0);
      }
    }
  }
}

TEST(CudaModelProperties, LargeTwoMiBMultiplesWithoutReuseReserveExactlyWhatTheyAllocate) {
  // From 10 MiB a request gets a segment of its size rounded to 2 MiB: none is wasted.
  for (uint32_t seed = 21; seed <= 24; ++seed) {
    std::mt19937 rng(seed);
    std::vector<AllocationEvent> events;
    int64_t total = 0;
    for (int i = 1; i <= 100; ++i) {
      const int64_t bytes = 2 * MiB * std::uniform_int_distribution<int64_t>(5, 200)(rng);
      events.push_back({reinterpret_cast<const void*>(static_cast<uintptr_t>(i) * 64), bytes});
      total += bytes;
    }
    for (CudaAllocatorRules rules : {k1_13, k2}) {
      CudaAllocatorModel m(options(rules));
      const AllocationReplay r = replay_allocations(m, events);
      EXPECT_EQ(r.peak_reserved, total);
      EXPECT_EQ(r.peak_allocated, total);
    }
  }
}

TEST(CudaModelProperties, VersionsAgreeWithoutSettingsAndReplaysAreDeterministic) {
  for (uint32_t seed = 31; seed <= 34; ++seed) {
    const auto events = random_trace(seed, 500, 0.5).events;
    CudaAllocatorModel a(options(k1_13)), b(options(k2)), c(options(k2));
    const AllocationReplay ra = replay_allocations(a, events), rb = replay_allocations(b, events),
                           rc = replay_allocations(c, events);
    EXPECT_EQ(ra.reserved_series, rb.reserved_series);
    EXPECT_EQ(rb.reserved_series, rc.reserved_series);
    EXPECT_EQ(ra.peak_reserved, rb.peak_reserved);
    EXPECT_EQ(rb.reserved_series.size(), events.size() + 1);  // the start, then one per event
  }
}

TEST(CudaModelProperties, ALimitIsNeverPassed) {
  for (uint32_t seed = 41; seed <= 46; ++seed) {
    for (const char* conf : kConfs2x) {
      CudaAllocatorModel m(options(k2, conf, /*limit=*/256 * MiB));
      const AllocationReplay r = replay_allocations(m, random_trace(seed, 400, 0.45).events);
      EXPECT_LE(r.peak_reserved, 256 * MiB) << conf;
    }
  }
}

}  // namespace
}  // namespace memfit
