"""Proposers: what drafts the token tree the target verifies, one module per drafter kind.

    base.py           the Proposer interface, shared helpers, the kind registry and build_proposer
    draft_model.py    a small causal LM drafting a chain (kind draft_model)
    prompt_lookup.py  n-gram lookup in the sequence (kind prompt_lookup; the `+prompt_lookup` wrapper)
    ensemble.py       several draft models' chains merged into one tree (kind ensemble)
    medusa.py         Medusa heads on the target's hidden states (kind medusa)
    lookahead.py      [LA] rows in the target's own forward (kind lookahead)
    eagle3.py         EAGLE-3 feature-level drafting with EAGLE-2 dynamic trees (kind eagle3)
    dflash.py         DFlash block drafting: a whole block in one forward over the target's features (kind dflash)

A kind module imports base (and the kinds it builds on), never this package, and registers its builder
at import with `register_proposer`; importing this package imports every kind, so all are registered.
A new kind is a new module here plus its import below.
"""

from specdistill.decode.proposers import dflash, draft_model, eagle3, ensemble, lookahead, medusa, prompt_lookup  # noqa: F401  (register)
from specdistill.decode.proposers.base import (
                                   CATCH_UP_SPLIT,
                                   Alternate,
                                   Proposer,
                                   build_proposer,
                                   common_prefix_len,
                                   drafter_proposer,
                                   register_proposer,
                                   register_wrapper,
                                   use_gemv_friendly_head,
                                   vocab_size,
)
from specdistill.decode.proposers.draft_model import DraftModelProposer, check_vocab
from specdistill.decode.proposers.medusa import check_medusa_vocab
from specdistill.decode.proposers.prompt_lookup import (
                                   LOOKUP_SOURCE,
                                   PromptLookupProposer,
                                   WithPromptLookup,
                                   lookup_continuation,
                                   prompt_lookup_proposer,
)

__all__ = [
    "Alternate", "CATCH_UP_SPLIT", "DraftModelProposer", "LOOKUP_SOURCE", "PromptLookupProposer", "Proposer",
    "WithPromptLookup", "build_proposer", "check_medusa_vocab", "check_vocab", "common_prefix_len",
    "drafter_proposer", "lookup_continuation", "prompt_lookup_proposer", "register_proposer", "register_wrapper",
    "use_gemv_friendly_head", "vocab_size",
]
