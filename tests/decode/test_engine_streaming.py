"""The engine's on_emit hook: what it streams is exactly the final output, and it can stop early."""

import torch

from specdistill.decode.engine import SpeculativeEngine
from specdistill.decode.proposers import PromptLookupProposer
from tests.conftest import make_tiny_llama


def _engine(proposer=None, eos=frozenset()):
    torch.manual_seed(0)
    model = make_tiny_llama(vocab_size=64, layers=2)
    return SpeculativeEngine(model, proposer, eos_token_ids=set(eos))


def test_streamed_tokens_concatenate_to_the_output():
    for proposer in (None, PromptLookupProposer(num_tokens=4)):
        engine = _engine(proposer, eos={7})
        chunks = []
        gen = engine.generate([1, 2, 3, 1, 2], 40, on_emit=lambda toks, chunks=chunks: chunks.append(list(toks)))
        assert sum(chunks, []) == gen.tokens
        assert all(chunks[:-1]), "only the last chunk may be empty"


def test_on_emit_returning_true_stops_generation():
    engine = _engine()
    full = engine.generate([1, 2, 3], 30).tokens
    seen = []

    def stop_after_five(toks):
        seen.extend(toks)
        return len(seen) >= 5

    cut = engine.generate([1, 2, 3], 30, on_emit=stop_after_five).tokens
    assert cut == full[:len(cut)] and 5 <= len(cut) < len(full)
