import inspect
import warnings

import torch

from specdistill.decode.runner import ModelRunner
from specdistill.models.hf_compat import cache_argument, output_cache


class OldStyle(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, use_cache=False):
        return input_ids


class NewStyle(torch.nn.Module):
    def forward(self, input_ids, cache=None, use_cache=False):
        return input_ids


def test_the_cache_goes_under_the_name_the_forward_declares():
    cache = object()
    assert cache_argument(OldStyle(), cache) == {"past_key_values": cache}
    assert cache_argument(NewStyle(), cache) == {"cache": cache}


def test_the_installed_transformers_gets_its_own_name(tiny_target):
    decoder = tiny_target.get_decoder()
    declared = inspect.signature(type(decoder).forward).parameters
    (name,) = cache_argument(decoder, None)
    assert name in declared


def test_a_forward_returns_its_cache_under_either_field(tiny_target):
    ids = torch.tensor([[1, 2, 3]])
    out = tiny_target(input_ids=ids, use_cache=True)
    again = tiny_target(input_ids=torch.tensor([[4]]), **cache_argument(tiny_target, output_cache(out)),
                        use_cache=True)
    assert output_cache(again).get_seq_length() == 4


def test_the_runner_passes_its_cache_without_a_deprecation_warning(tiny_target):
    runner = ModelRunner(tiny_target)
    runner.start(16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.inference_mode():
            runner.forward([1, 2, 3])
