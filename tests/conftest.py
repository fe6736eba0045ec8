import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

TESTS = Path(__file__).parent
ROOT = TESTS.parent
for path in (ROOT, TESTS):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

from chat import ChatEngine  # noqa: E402
from chat.demo import build_tokenizer  # noqa: E402
from tiny_models import ARCHS, build_model  # noqa: E402

FIXTURES = TESTS / "fixtures"
THINKING_TEMPLATE = "qwen3"  # reads reasoning_content, drops earlier <think> blocks
PLAIN_TEMPLATE = "qwen2_5"  # knows nothing of reasoning


def count_forwards(model, monkeypatch) -> list:
    """Each forward pass of `model` from now on appends to the list returned (until monkeypatch
    undoes it): each call of its output layer, which every step runs once, the model's own
    forward and the runner's plain step alike (chat/model_step/plain_step.py)."""
    calls = []
    head = model.get_output_embeddings()
    original = head.forward

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(head, "forward", counting)
    return calls


def forwards_before_first_token(model, monkeypatch) -> Callable[[Callable[[], Any]], list[int]]:
    """`measure(action)` runs `action` and returns, for each reply's first token emitted meanwhile,
    how many forward passes of `model` (`count_forwards`) had run since `action` began."""
    from chat.scheduling.requests import GenerationRequest

    forwards, at_first = count_forwards(model, monkeypatch), []
    emit = GenerationRequest._emit

    def noted(request, token_id):
        if request.token_count == 0:
            at_first.append(len(forwards))
        emit(request, token_id)

    monkeypatch.setattr(GenerationRequest, "_emit", noted)

    def measure(action: Callable[[], Any]) -> list[int]:
        forwards.clear(), at_first.clear()
        action()
        return list(at_first)

    return measure


def on_model_input(model, monkeypatch, seen) -> None:
    """`seen(input_ids)` before every forward pass of `model`, whichever way the step runs it
    (its token embedding is the first thing each runs), until monkeypatch undoes it."""
    embedding = model.get_input_embeddings()
    original = embedding.forward

    def watched(input_ids, *args, **kwargs):
        seen(input_ids)
        return original(input_ids, *args, **kwargs)

    monkeypatch.setattr(embedding, "forward", watched)


@pytest.fixture(scope="session")
def base_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="session")
def models(base_tokenizer):
    eos = base_tokenizer.convert_tokens_to_ids("<|im_end|>")
    return {arch: build_model(arch, len(base_tokenizer), eos) for arch in ARCHS}


def tokenizer_with_template(base_tokenizer, template: str):
    tokenizer = copy.deepcopy(base_tokenizer)
    tokenizer.chat_template = (FIXTURES / f"{template}.jinja").read_text()
    return tokenizer


@pytest.fixture(scope="session")
def tokenizers(base_tokenizer):
    return {name: tokenizer_with_template(base_tokenizer, name) for name in (THINKING_TEMPLATE, PLAIN_TEMPLATE)}


@pytest.fixture
def make_engine(models, tokenizers):
    def make(arch: str, template: str = THINKING_TEMPLATE, **options) -> ChatEngine:
        return ChatEngine(models[arch], tokenizers[template], **options)

    return make
