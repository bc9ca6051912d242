"""Caps the GPU memory another process can use, by holding the rest (scripts/gpu-check.sh's
batch rows under ENGY_GPU_BENCH_CAP_GIB: a card smaller than the model, on a large one).

    python3 bench/gpu/hold_memory.py CAP_GIB

Allocates all of GPU 0's free memory but CAP_GIB GiB with torch, prints one line
`held H GiB, CAP_GIB GiB left free` on stdout once it holds it, then keeps it until its
stdin closes. Exit status 1 (and a line on stderr) when the card has less than CAP_GIB free
or CUDA does not start.
"""

import sys


def main() -> int:
    if len(sys.argv) != 2:
        print("usage: hold_memory.py CAP_GIB", file=sys.stderr)
        return 2
    cap = float(sys.argv[1])
    try:
        import torch

        free, _total = torch.cuda.mem_get_info(0)
    except Exception as e:  # noqa: BLE001: any failure to start CUDA is reported the same way
        print(f"hold_memory.py: CUDA did not start: {e}", file=sys.stderr)
        return 1
    keep = int(cap * 2**30)
    if free < keep:
        print(f"hold_memory.py: {free / 2**30:.1f} GiB free, fewer than the {cap} GiB cap",
              file=sys.stderr)
        return 1
    held = torch.empty(free - keep, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    print(f"held {held.numel() / 2**30:.1f} GiB, {cap} GiB left free", flush=True)
    sys.stdin.read()
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
