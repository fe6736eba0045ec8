"""Issue check 3: the exactness comparison does catch a wrong cache."""

import pytest
import torch
from transformers import DynamicCache

from reference import LOGIT_TOLERANCE, cached_vs_scratch_logit_error, scratch_greedy_reply
from tiny_models import SLIDING_WINDOW

TOKENS = list(range(40, 100))


@torch.no_grad()
def test_plain_crop_of_a_recurrent_layer_is_detected(models, base_tokenizer):
    model = models["hybrid"]
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    model(input_ids=torch.tensor([TOKENS]), past_key_values=cache)
    cache.crop(-20)  # trims keys/values and conv states; the recurrent state still holds all 60 tokens
    kept = TOKENS[:-20]
    assert cache.get_seq_length() == len(kept)  # the library believes the crop worked

    error = cached_vs_scratch_logit_error(model, cache, kept, probe_id=7)
    assert error > 100 * LOGIT_TOLERANCE

    eos = {base_tokenizer.eos_token_id}
    prompt = kept + [7]
    wrong = model.generate(torch.tensor([prompt]), past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert wrong[0, len(prompt):].tolist() != scratch_greedy_reply(model, prompt, 8, eos)


@torch.no_grad()
def test_crop_past_the_recorded_window_is_detected(models):
    """The library's sliding crop keeps window-1 states; a second, deeper crop cannot be exact:
    the states it needs are gone, and the comparison with scratch fails loudly on them."""
    model = models["sliding"]
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    model(input_ids=torch.tensor([TOKENS]), past_key_values=cache)
    cache.crop(-2)
    cache.crop(-10)
    kept = TOKENS[:-12]
    assert cache.get_seq_length() == len(kept)  # the library believes the crop worked
    assert all(layer.keys.shape[-2] < SLIDING_WINDOW - 1 for layer in cache.layers)  # but the window is gone
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):
        cached_vs_scratch_logit_error(model, cache, kept, probe_id=7)
