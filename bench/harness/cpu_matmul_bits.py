"""Do this machine's CPU matrix products give the same bits for the same numbers?

Bit-exact training (resume, ZeRO 3 against one process) needs every product to round the same
way whenever its inputs are equal. A BLAS may not: oneMKL promises equal bits only at a fixed
thread count, and may take another code path for operands at another address (its kernels
differ per instruction set: AVX2 on AMD, AVX-512 on a Xeon). A training run's tensors sit at
addresses that vary run to run (64-byte aligned by the allocator, not more), so a product whose
bits follow the address would make runs differ by chance. This checks, with the torch it runs
under, the products a GPT block makes (linear forward, its weight gradient, attention's batched
product):

  1. address: the same operands copied to offsets 0..OFFSETS floats into a larger buffer, at
     every float and at every 16 floats (64 bytes), against offset 0 (--threads threads);
  2. threads: the same product at 1..--threads threads, against 1 thread (expected to differ);
  3. repeat: the same product REPEATS times at --threads threads, same operands, same address.

One line per product and check: how many results differed from the first, and the first few
offsets or thread counts that did, with the buffer's address modulo 4096.

  python3 bench/harness/cpu_matmul_bits.py [--threads N] [--offsets 1024] [--repeats 20]
"""
import argparse

import torch

# (name, m, k, n): linear's input rows x features in x features out; sizes of the GPTs in
# bench/RESULTS.md's ZeRO 3 section (d=256 and d=512, seq 64-128, a few samples).
PRODUCTS = [("linear d256", 128, 256, 768), ("linear d256 mlp-out", 128, 1024, 256),
            ("linear d512", 512, 512, 2048), ("linear d512 mlp-out", 512, 2048, 512)]
BMM = ("attention bmm", 32, 128, 64)  # heads x samples, seq, head size


def placed(t, offset):
    """t's values in a fresh buffer, starting `offset` floats in."""
    buf = torch.empty(t.numel() + offset + 64)
    view = buf[offset:offset + t.numel()].view(t.shape)
    view.copy_(t)
    return view, buf.data_ptr() % 4096


def linear_and_grad(x, w):
    y = torch.nn.functional.linear(x, w)
    return y, y.t() @ x  # the weight gradient's shape of product


def bmm_pair(q, k):
    s = torch.bmm(q, k.transpose(1, 2))
    return s, torch.bmm(s, q)


def same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


def check_address(name, fn, args, offsets, step):
    ref = fn(*args)
    differs = []
    for off in range(0, offsets + 1, step):
        moved = [placed(a, off) for a in args]
        out = fn(*(m for m, _ in moved))
        if not same(out, ref):
            differs.append(f"{off} (address % 4096 = {moved[0][1]})")
    total = offsets // step + 1
    print(f"{name:22s} address, every {step:2d} float(s): {len(differs)} of {total} differ" +
          (": " + ", ".join(differs[:5]) if differs else ""))
    return len(differs)


def check_threads(name, fn, args, threads):
    results = {}
    for t in range(1, threads + 1):
        torch.set_num_threads(t)
        results[t] = fn(*args)
    torch.set_num_threads(threads)
    differs = [t for t in results if not same(results[t], results[1])]
    print(f"{name:22s} threads 1..{threads}: {len(differs)} differ from 1 thread" +
          (f": {differs}" if differs else ""))


def check_repeat(name, fn, args, repeats):
    ref = fn(*args)
    differs = sum(0 if same(fn(*args), ref) else 1 for _ in range(repeats))
    print(f"{name:22s} {repeats} repeats: {differs} differ")
    return differs


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--offsets", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=20)
    o = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(o.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"BLAS: {'oneMKL' if torch.backends.mkl.is_available() else 'not oneMKL'}")
    cases = [(name, linear_and_grad, (torch.randn(m, k), torch.randn(n, k))) for name, m, k, n in PRODUCTS]
    b, s, h = BMM[1:]
    cases.append((BMM[0], bmm_pair, (torch.randn(b, s, h), torch.randn(b, s, h))))
    unstable = 0
    for name, fn, args in cases:
        unstable += check_address(name, fn, args, o.offsets, 1)
        unstable += check_address(name, fn, args, o.offsets, 16)
        check_threads(name, fn, args, o.threads)
        unstable += check_repeat(name, fn, args, o.repeats)
    print("cpu_matmul_bits: " + ("the same bits at every address and repeat" if unstable == 0 else
                                 f"{unstable} results differ by address or repeat alone: "
                                 "runs with equal inputs can give different weights"))


if __name__ == "__main__":
    main()
