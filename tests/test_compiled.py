"""The compiled decode step (chat/model_step/compiled.py): each step against a
from-scratch forward over the whole sequence (fp32 and int8 weights), one graph for every length
and buffer capacity, rollback into compiled steps, and every operation of an engine that uses it
held to the same references as the eager engine (tests/reference.py)."""

import os
import pickle
import stat
import threading
import time

import pytest
import torch
from conftest import THINKING_TEMPLATE
from reference import LOGIT_TOLERANCE, check_exact, int8_logit_tolerance
from test_exactness import MAX_NEW, every_operation
from tiny_models import build_model

from cache_sessions import CacheSession
from chat.model_step import compiled as compiled_module
from chat.model_step.compiled import CompiledDecode, graph_key
from cache_sessions.sealed import Sealer
from chat import ChatEngine
from chat.config import EngineConfig
from chat.model_step.weights import apply_weight_format
from chat.model_step.feeding import feed, rewind_and_prefill

WAIT_S = 600  # compiling on a busy 2-core machine: minutes at worst


def scratch_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0, -1]


def test_each_compiled_step_gives_a_from_scratch_forwards_logits_with_one_graph_a_bucket(base_tokenizer):
    """One row alone, then three rows on the four-row graph (one idle row), then one row again
    after a rollback: every row's logits against a from-scratch forward over its whole sequence."""
    model = build_model("full", len(base_tokenizer), None)  # 4 query heads on 2 key/value heads
    compiled = CompiledDecode(model, "on", max_rows=3)
    assert compiled.buckets == (1, 2, 4)
    compiled.warm()
    assert compiled.wait(0) and compiled.ready and compiled.error is None and compiled.graphs == 3
    sessions = []
    for start in (30, 60, 90):
        sessions.append(CacheSession(model))
        feed(model, sessions[-1], list(range(start, start + 17 + start // 10)))  # three lengths
    tokens, capacities = [7, 8, 9], set()
    for step in range(40):
        rows = [(session, [token]) for session, token in zip(sessions, tokens)][: 1 if step < 10 else 3]
        assert compiled.takes(rows, list(range(len(rows))))
        logits = compiled.step(rows)
        assert logits.shape[0] == len(rows)
        for row, (session, fed) in enumerate(rows):
            session.note_extended(fed)
            expected = scratch_logits(model, session.token_ids)
            torch.testing.assert_close(logits[row], expected, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
            tokens[row] = int(expected.argmax())
        capacities.add(sessions[0].cache.layers[0]._key_buffer.shape[-2])
    assert len(capacities) > 1  # the buffers grew on the way, and the graphs read them in place
    assert compiled.steps == 40 and compiled.error is None  # every length and capacity passed the guards
    # rolled back into what compiled steps wrote, the next step reads the kept part only
    session = sessions[0]
    rewind_and_prefill(model, session, session.token_ids[:-25] + [11])  # the kept part; 11 is the next token fed
    logits = compiled.step([(session, [11])])
    session.note_extended([11])
    torch.testing.assert_close(logits[0], scratch_logits(model, session.token_ids), atol=LOGIT_TOLERANCE,
                               rtol=LOGIT_TOLERANCE)
    # anything else is the packed eager forward's: a prompt piece, more rows than a graph holds
    assert not compiled.takes([(session, [1, 2])], [0])
    assert not compiled.takes([(s, [1]) for s in sessions] + [(CacheSession(model), [2])] * 2, list(range(5)))


@pytest.mark.parametrize("weights", ["int8", "packed"])
def test_a_compiled_step_with_int8_or_packed_weights_gives_a_from_scratch_forwards_logits(base_tokenizer, weights):
    """The weight-only int8 kernel (or oneDNN's product of packed weights) inside the graph: each
    step within the int8 tolerance (fp32's, packed) of a from-scratch forward of the same model."""
    model = apply_weight_format(build_model("full", len(base_tokenizer), None), weights)
    tolerance = int8_logit_tolerance(model) if weights == "int8" else LOGIT_TOLERANCE
    compiled = CompiledDecode(model, "on", max_rows=1)
    compiled.warm()
    assert compiled.ready and compiled.error is None
    session = CacheSession(model)
    feed(model, session, list(range(30, 60)))
    token = 7
    for _ in range(12):
        logits = compiled.step([(session, [token])])
        session.note_extended([token])
        expected = scratch_logits(model, session.token_ids)
        torch.testing.assert_close(logits[0], expected, atol=tolerance, rtol=0)
        token = int(expected.argmax())
    assert compiled.steps == 12


def test_a_restart_loads_the_saved_graphs_and_they_give_a_from_scratch_forwards_logits(base_tokenizer, tmp_path):
    """Graphs saved by one start are loaded by the next (no trace), only by a model they were
    traced from, and a damaged file is compiled again rather than trusted."""
    model = build_model("full", len(base_tokenizer), None)
    first = CompiledDecode(model, "on", max_rows=2, store=tmp_path)
    first.warm()
    assert first.ready and first.error is None and first.loaded == set()
    saved = sorted(path.name for path in tmp_path.iterdir() if path.suffix == ".graph")
    assert saved == sorted(f"{graph_key(model, rows)}.graph" for rows in (1, 2))
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700 and stat.S_IMODE((tmp_path / "seal.key").stat().st_mode) == 0o600
    restarted = CompiledDecode(model, "on", max_rows=2, store=tmp_path)
    restarted.warm()
    assert restarted.ready and restarted.error is None and restarted.loaded == {1, 2} and restarted.graphs == 2
    sessions = [CacheSession(model), CacheSession(model)]
    feed(model, sessions[0], list(range(30, 61)))
    feed(model, sessions[1], list(range(40, 52)))
    tokens = [7, 8]
    for _ in range(6):
        rows = [(session, [token]) for session, token in zip(sessions, tokens)]
        logits = restarted.step(rows)
        for row, (session, fed) in enumerate(rows):
            session.note_extended(fed)
            expected = scratch_logits(model, session.token_ids)
            torch.testing.assert_close(logits[row], expected, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
            tokens[row] = int(expected.argmax())
    # another model (more layers): another key, so compiled, not loaded
    deeper = build_model("full", len(base_tokenizer), None)
    deeper.config.num_hidden_layers += 1
    assert graph_key(deeper, 1) != graph_key(model, 1)
    # a file put in a graph's place that runs code when unpickled is never
    # unpickled (its seal does not verify): compiled again, and sealed over
    planted = tmp_path / f"{graph_key(model, 1)}.graph"
    ran = tmp_path / "the planted file ran"
    planted.write_bytes(pickle.dumps(RunsCode(f"touch '{ran}'")))
    again = CompiledDecode(model, "on", max_rows=1, store=tmp_path)
    again.warm()
    assert not ran.exists()
    assert again.ready and again.error is None and again.loaded == set()
    assert planted.stat().st_size > 1000 and Sealer(tmp_path).read(planted.name) is not None


class RunsCode:
    """A pickle that runs a shell command when it is loaded (what an attack planted)."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_store_another_user_can_write_is_neither_read_nor_written(base_tokenizer, tmp_path):
    """A graph folder others can write (mode 0777): nothing is loaded from it (not even a
    correctly sealed file: the key beside it is exposed too) and nothing saved; the steps are
    compiled in memory and /status says why."""
    model = build_model("full", len(base_tokenizer), None)
    store = tmp_path / "steps"
    store.mkdir()
    store.chmod(0o777)
    compiled = CompiledDecode(model, "on", max_rows=1, store=store)
    compiled.warm()
    assert compiled.ready and compiled.error is None and compiled.loaded == set()
    assert list(store.iterdir()) == [] and "can be written by other users" in compiled.stats()["store_refused"]


def test_a_step_that_would_compile_again_goes_back_to_eager_with_nothing_fed(base_tokenizer):
    """A new graph would stall every user on the loop: refused before anything runs."""
    model = build_model("full", len(base_tokenizer), None)
    compiled = CompiledDecode(model, "on")
    compiled.warm()
    session = CacheSession(model)
    feed(model, session, list(range(30, 50)))
    for layer in session.cache.layers:  # states of another dtype: a guard of the graph fails
        layer.keys, layer.values = layer.keys.double(), layer.values.double()
    assert compiled.ready and compiled.error is None
    assert compiled.step([(session, [7])]) is None
    assert not compiled.ready and "compiled again" in compiled.stats()["not_compiled_because"]
    assert len(session.token_ids) == 20 and session.cache.get_seq_length() == 20
    assert not compiled.takes([(session, [7])], [0])


def test_a_graph_that_fails_at_run_time_is_retired_for_eager_and_a_refused_file_is_kept(base_tokenizer, tmp_path,
                                                                                     monkeypatch):
    """A compiled step that raised anything but a failed guard was raised again at
    every step (every row ended, each time). Now it is retired at once, with nothing fed, and
    the steps go eager. And a saved graph that loads but refuses this model is not sealed over
    (two such models would each compile again at every start)."""
    model = build_model("full", len(base_tokenizer), None)
    compiled = CompiledDecode(model, "on", max_rows=1, store=tmp_path)
    compiled.warm()
    assert compiled.ready
    session = CacheSession(model)
    feed(model, session, list(range(30, 50)))

    def fails(*args):
        raise RuntimeError("a kernel failed")

    compiled._graphs[1] = fails
    assert compiled.step([(session, [7])]) is None
    assert not compiled.ready and not compiled.takes([(session, [7])], [0])
    assert "the compiled step failed (RuntimeError): a kernel failed" in compiled.stats()["not_compiled_because"]
    assert len(session.token_ids) == 20 and session.cache.get_seq_length() == 20
    # a loaded graph whose check on scratch buffers fails: compiled again in memory, the file kept
    saved = tmp_path / f"{graph_key(model, 1)}.graph"
    before = saved.read_bytes()
    checks = []
    run_scratch = compiled_module.GraphMaker._run_scratch

    def refuses_the_loaded_one(self, graph, bucket, which):
        checks.append(graph)
        if len(checks) == 1:
            raise RuntimeError("GuardManager check failed")
        return run_scratch(self, graph, bucket, which)

    monkeypatch.setattr(compiled_module.GraphMaker, "_run_scratch", refuses_the_loaded_one)
    again = CompiledDecode(model, "on", max_rows=1, store=tmp_path)
    again.warm()
    assert again.ready and again.loaded == set() and len(checks) == 2  # the loaded one, then the new one
    assert saved.read_bytes() == before


def test_a_ready_graph_serves_while_another_is_being_built(base_tokenizer):
    """A graph compiled ahead of time runs without dynamo: the one-row steps go on, compiled and
    exact, while another graph of this process is traced and compiled on its thread."""
    model = build_model("full", len(base_tokenizer), None)
    ready = CompiledDecode(model, "on", max_rows=1)
    ready.warm()
    other = CompiledDecode(build_model("full", len(base_tokenizer), None, seed=1), "on", max_rows=2)
    building = threading.Thread(target=other.warm)
    building.start()
    deadline = time.monotonic() + WAIT_S
    while not compiled_module._BUILDING.locked() and building.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)  # until the other build holds the lock
    session = CacheSession(model)
    feed(model, session, list(range(30, 60)))
    token, during = 7, 0
    while True:
        was_building = compiled_module._BUILDING.locked()
        logits = ready.step([(session, [token])])
        during += was_building and compiled_module._BUILDING.locked()
        session.note_extended([token])
        expected = scratch_logits(model, session.token_ids)
        torch.testing.assert_close(logits[0], expected, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)
        token = int(expected.argmax())
        if not building.is_alive():
            break
    building.join(WAIT_S)
    assert during >= 1, "no step ran while the other graph was being built"
    assert other.wait(0) and other.error is None and ready.error is None


def test_no_tracer_that_patches_every_modules_call_runs_on_the_compiling_thread(base_tokenizer, tmp_path,
                                                                               monkeypatch):
    """While `torch.fx.symbolic_trace` traces, `nn.Module.__call__` is patched for the whole
    process and an eager step on the loop fails ("module is not installed as a submodule"); inductor
    traces one such placeholder when it first lowers a graph. It must be traced before the compiling
    thread starts, so a cold start's eager replies never meet it. Lowered for real here: inductor's
    caches off and the placeholder forgotten, as in a fresh process."""
    from torch._inductor.loop_body import InterpreterShim

    traced_on: list[str] = []
    original = torch.fx.Tracer.trace

    def recording(tracer, *args, **kwargs):
        if type(tracer).call_module is torch.fx.Tracer.call_module:  # make_fx's tracers run modules as they are
            traced_on.append(threading.current_thread().name)
        return original(tracer, *args, **kwargs)

    monkeypatch.setattr(torch.fx.Tracer, "trace", recording)
    InterpreterShim._dummy_gm.cache_clear()
    model = build_model("full", len(base_tokenizer), None)
    compiled = CompiledDecode(model, "on", max_rows=1, store=tmp_path / "steps")
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled.start()
        assert compiled.wait(WAIT_S) and compiled.error is None
    assert compiled.loaded == set()  # compiled, not loaded: the graph was lowered
    assert traced_on and "compile-decode-step" not in traced_on, traced_on


def test_the_cpus_vector_instructions_are_probed_before_the_compiling_thread_lowers_its_priority(
        base_tokenizer, tmp_path, monkeypatch):
    """Inductor probes them in child processes that inherit the thread's priority; at nice 19
    beside a busy loop the probe starved (and a probe that passes 60 s counts as failed: a graph
    without them). The first probe must come before the thread's priority drops."""
    from torch._inductor import cpu_vec_isa

    events: list[str] = []
    own_pick, own_lower = cpu_vec_isa.pick_vec_isa, compiled_module._lower_thread_priority
    monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", lambda: events.append("probe") or own_pick())
    monkeypatch.setattr(compiled_module, "_lower_thread_priority", lambda nice: events.append("nice") or own_lower(nice))
    compiled = CompiledDecode(build_model("full", len(base_tokenizer), None), "on", max_rows=1, store=tmp_path / "s")
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        compiled.start()
        assert compiled.wait(WAIT_S) and compiled.error is None
    assert "nice" in events and "probe" in events[:events.index("nice")], events[:5]


def test_every_operation_of_a_compiled_engine_is_exact(tokenizers):
    tokenizer = tokenizers[THINKING_TEMPLATE]
    model = build_model("full", len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>"))
    engine = ChatEngine(model, tokenizer, compile="on", max_batch_size=2)
    assert engine.compiled.wait(WAIT_S), engine.compiled.stats()
    conv = engine.conversation("You are terse.")
    every_operation(conv, lambda **kwargs: check_exact(conv, model, tokenizer, max_new_tokens=MAX_NEW, **kwargs))
    status = engine.status()["compiled_step"]
    assert status["ready"] and status["steps"] > 0 and status["graphs"] >= 1 and status["compile_s"] is not None
    assert status["compile_priority"] == "nice 19"  # the compiling thread yields the cores to the steps


def test_what_is_not_compiled_says_why(base_tokenizer):
    small = CompiledDecode(build_model("full", len(base_tokenizer), None), "auto")
    assert not small.enabled and "compiled from 200 M" in small.stats()["not_compiled_because"]
    sliding = CompiledDecode(build_model("sliding", len(base_tokenizer), None), "on")
    assert not sliding.enabled and "full-attention Llama, Mistral, Qwen2 and Qwen3 only" in sliding.reason
    gemma = CompiledDecode(build_model("mixed", len(base_tokenizer), None), "on")
    assert not gemma.enabled and "full-attention Llama, Mistral, Qwen2 and Qwen3 only" in gemma.reason
    hybrid = CompiledDecode(build_model("hybrid", len(base_tokenizer), None), "on")
    assert not hybrid.enabled and "Qwen3NextForCausalLM is not one of the plain decoders" in hybrid.reason
    off = CompiledDecode(build_model("full", len(base_tokenizer), None), "off")
    off.start()
    assert not off.enabled and not off.ready and off.stats()["not_compiled_because"] == "off"
    with pytest.raises(ValueError, match="compile is one of auto, on, off, not 'fast'"):
        EngineConfig(compile="fast")
    waiting = threading.Thread(target=off.wait)  # nothing to wait for: returns at once
    waiting.start()
    waiting.join(60)
    assert not waiting.is_alive() and not off.wait()


def test_auto_counts_int8_weights_as_the_models_size(base_tokenizer, monkeypatch):
    """int8 layers keep their weights as buffers: `auto` sizes the model by those too."""
    model = build_model("full", len(base_tokenizer), None)
    size = sum(parameter.numel() for parameter in model.parameters())
    monkeypatch.setattr(compiled_module, "AUTO_MIN_PARAMETERS", size * 0.9)
    assert CompiledDecode(model, "auto").enabled
    assert CompiledDecode(apply_weight_format(model, "int8"), "auto").enabled
