"""engy cells: capture the sampled-audit cells (specs/CELLS.md, scheme engy-cells/v2) of a
teacher-forced commit pass with forward hooks, in sglang (`--forward-hooks`) or in
transformers. See integrations/sglang/README.md.
"""
from .format import SCHEME  # noqa: F401
