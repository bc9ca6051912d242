"""honest_serves.py with the DSA indexer's order among exactly equal index scores chosen.

transformers' `GlmMoeDsaIndexer` selects keys with `index_scores.topk(index_topk)`. On the CPU
torch's `topk` keeps, among values equal to the k-th, the ones libstdc++'s `nth_element`
(introselect; `partial_sort` once `64 k <= n`) leaves in front: a run that depends on the row's
length (padding included) and on the other values, neither the lowest nor the highest indices.
With few indexer heads many index scores are exactly 0 (`relu` zeroes every head's score of a
key, `weights_proj` negative on the others), so selections cut through such ties often
(docs/design/dsa-ties.md). This runs tests/reverse/honest_serves.py unchanged except for that
order:

  --ties torch        torch's own order (the same as honest_serves.py)
  --ties lower-first  equal scores taken lower key index first (a stable descending sort),
                      the order engy's recompute takes first (`arch::TieOrder::LowerFirst`)
  --ties higher-first equal scores taken higher key index first

  $ENGY_TF5_PYTHON tests/reverse/dsa_ties_serves.py --ties lower-first [--count] CASE \
      OUT.safetensors [honest_serves.py's options]

--count prints, after the serve, how many (query row, layer) selections had more than
`index_topk` unmasked keys, how many of them cut through a tie (a key left out scores exactly
what the least kept key scores) and how many tied keys those rows had in all
(docs/design/dsa-ties.md's table).

Exit 0, or 2 on a usage error.
"""
import os, sys

import torch
import transformers.models.glm_moe_dsa.modeling_glm_moe_dsa as glm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import honest_serves  # noqa: E402

_topk = torch.Tensor.topk


def ordered_topk(ties):
    def topk(self, k, dim=-1, largest=True, sorted=True):
        if ties == "higher-first":
            # Stable on the reversed row: among equal values the later key comes first.
            flipped = self.flip(dim)
            idx = torch.sort(flipped, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
            idx = self.shape[dim] - 1 - idx
        else:
            idx = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))
    return topk


def main():
    args = sys.argv[1:]
    if len(args) < 2 or args[0] != "--ties" or args[1] not in ("torch", "lower-first", "higher-first"):
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    ties = args[1]
    count = len(args) > 2 and args[2] == "--count"
    rest = args[3:] if count else args[2:]
    stats = {"rows": 0, "cut": 0, "tied_keys": 0}
    chosen = _topk if ties == "torch" else ordered_topk(ties)

    def counted(self, k, dim=-1, largest=True, sorted=True):
        r = chosen(self, k, dim=dim, largest=largest, sorted=sorted)
        kth = r.values.narrow(dim, k - 1, 1)
        valid = self > -1e30  # masked keys are -inf or finfo.min
        n_valid = valid.sum(dim)
        eq = ((self == kth) & valid).sum(dim)
        above = ((self > kth) & valid).sum(dim)
        judged = n_valid > k
        cut = judged & (above + eq > k)
        stats["rows"] += int(judged.sum())
        stats["cut"] += int(cut.sum())
        stats["tied_keys"] += int((eq * cut).sum())
        return r

    if ties != "torch" or count:
        forward = glm.GlmMoeDsaIndexer.forward
        used = counted if count else chosen

        def indexer_forward(self, *a, **kw):
            torch.Tensor.topk = used
            try:
                return forward(self, *a, **kw)
            finally:
                torch.Tensor.topk = _topk
        glm.GlmMoeDsaIndexer.forward = indexer_forward
    sys.argv = [sys.argv[0]] + rest
    honest_serves.main()
    if count:
        print(f"indexer selections with more than index_topk keys: {stats['rows']}, cut through a tie: "
              f"{stats['cut']}, tied keys in those: {stats['tied_keys']}")


if __name__ == "__main__":
    main()
