# Sourced by the benchmark scripts (and worth sourcing before any timing by hand):
#   source bench/harness/quiet_env.sh
# On these 2-core machines two things otherwise take about a third of a training step's time,
# as system time, and make step times vary by +-20% from run to run:
#  - OpenMP's spin-waiting threads (libgomp's default), competing with the threads doing work;
#  - glibc handing freed tensor memory back to the kernel (munmap, heap trimming), so the next
#    step page-faults the same bytes in again.
# Both are settings of the process, not of memfit or PyTorch: the benchmarks set them for both
# sides alike. Bytes counted by the allocator hooks are unaffected.
export OMP_WAIT_POLICY=PASSIVE
export MALLOC_MMAP_THRESHOLD_=4294967296   # no mmap for tensors below 4 GiB: freed bytes stay in the heap
export MALLOC_TRIM_THRESHOLD_=68719476736  # never trim the heap's top back to the kernel
export MALLOC_TOP_PAD_=1073741824          # grow the heap in 1 GiB steps
