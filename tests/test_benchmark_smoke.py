"""The benchmark runs end to end (a tiny run: no timing is asserted, only its bookkeeping)."""

import json

import pytest

from chat.models import build_model

from benchmarks.multiturn import main


def test_multiturn_benchmark_writes_the_documented_fields(tmp_path):
    out = tmp_path / "result.json"
    main(["--turns", "3", "--message-words", "12", "--max-new-tokens", "4", "--decode-tokens", "6",
          "--json", str(out), "--plot", str(tmp_path / "plot.png")])
    result = json.loads(out.read_text())
    assert {"config", "turns", "regenerate", "decode", "undo_send", "edit", "targets"} <= set(result)
    assert [row["turn"] for row in result["turns"]] == [1, 2, 3]
    for row in result["turns"]:
        assert {"ttft_s", "prefilled_tokens"} <= set(row["session"]) & set(row["naive"]) & set(row["floor"])
        assert row["same_reply"]  # session and naive generate the same greedy tokens
        assert row["session"]["prefilled_tokens"] == row["floor"]["prefilled_tokens"]  # no wasted prefill
    later = result["turns"][1:]
    assert all(row["session"]["prefilled_tokens"] < row["naive"]["prefilled_tokens"] for row in later)
    assert result["regenerate"]["session_prefilled_tokens"] == 0  # the whole prompt, the logits after it kept
    assert {"session_tokens_per_s", "bare_tokens_per_s"} <= set(result["decode"])
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_multiuser_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.multiuser import main as multiuser

    out = tmp_path / "multiuser.json"
    multiuser(["--history", "150", "--max-new-tokens", "5", "--counts", "1,2", "--stagger", "2",
               "--json", str(out), "--plot", str(tmp_path / "multiuser.png")])
    result = json.loads(out.read_text())
    assert [row["scenario"] for row in result["scenarios"]] == ["1 at once", "2 at once", "staggered"]
    for row in result["scenarios"]:
        assert row["same_as_alone"]  # batched greedy replies equal the replies alone
        assert len(row["ttft_s"]) == row["conversations"] and row["wall_s"] > 0
    assert result["largest_batch"] == 2  # two rows really shared decode steps
    assert {"alone_tokens_per_s", "bare_tokens_per_s"} <= set(result["decode"])
    assert (tmp_path / "multiuser.png").stat().st_size > 0


def test_branches_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.branches import main as branches

    out = tmp_path / "branches.json"
    branches(["--history", "120", "--branches", "2", "--message-words", "12", "--max-new-tokens", "4",
              "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert {"memory", "switch", "reload", "targets"} <= set(result)
    kept, freed = result["switch"]["kept_next_turn"][0], result["switch"]["freed_next_turn"][0]
    assert kept["prompt_tokens"] == freed["prompt_tokens"] or abs(kept["prompt_tokens"] - freed["prompt_tokens"]) < 40
    assert kept["prefilled_tokens"] < freed["prefilled_tokens"]  # the kept states were used
    assert result["memory"]["kept_segment_bytes"] > 0 and result["reload"]["restored"]["rebuilt"]


def test_planning_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.planning import main as planning

    out = tmp_path / "planning.json"
    result = planning(["--turns", "3,8", "--chars", "300", "--repeats", "1", "--old-up-to", "8",
                       "--json", str(out), "--markdown", str(tmp_path / "planning.md")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    rows = result["series"][0]["rows"]
    assert [row["turns"] for row in rows] == [3, 8] and all("old_s" in row for row in rows)  # the same cut both ways
    case = result["restored_send"]
    assert case["chars"] >= 1_990_000 and case["dropped_turns"] > 0 and case["plan_s"] > 0


def test_cold_tier_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.cold_tier import main as cold_tier

    out = tmp_path / "cold.json"
    cold_tier(["--tokens", "64", "--repeats", "2", "--cache-dir", str(tmp_path / "cold"), "--json", str(out),
               "--stall-tokens", "200", "--stall-reply", "30"])
    result = json.loads(out.read_text())
    assert result["tokens"] == 64 and len(result["runs"]["resume_s"]) == 2
    assert result["spill_s"] > 0 and result["write_s"] > 0 and result["stall"]["file_bytes"] > 0
    assert "worst_over_median" in result["stall"]
    assert result["file_bytes"] >= result["state_bytes"] > 0  # the file holds every byte of the states
    assert result["bytes_per_token"] == result["state_bytes"] / 64
    assert not list((tmp_path / "cold").glob("session-*.cold"))  # the store leaves nothing behind


def test_decode_speed_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.decode_speed import WAYS
    from benchmarks.decode_speed import main as decode_speed
    from cache_sessions.growing import GrowingLayer
    from cache_sessions.kv_cache import KVCacheKind

    out = tmp_path / "decode.json"
    result = decode_speed(["--lengths", "16,40", "--rows", "1,2", "--tokens", "3", "--repeats", "1",
                           "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    cells = {f"{way}/{length}/{rows}" for way in WAYS for length in (16, 40) for rows in (1, 2)}
    assert set(result["tokens_per_s"]) == cells and all(speed > 0 for speed in result["tokens_per_s"].values())
    assert len(result["targets"]) == 1  # one conversation's
    model = build_model("tiny-full", 64, None)  # the 'before' way put the engine's layers back
    assert all(isinstance(layer, GrowingLayer) for layer in KVCacheKind().new_cache(model).layers)


def test_kv_cache_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.kv_cache import KINDS
    from benchmarks.kv_cache import main as kv_cache

    out = tmp_path / "kv.json"
    result = kv_cache(["--tokens", "32", "--budget-mb", "2", "--replies", "2", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["resident"]) == set(KINDS) and result["resident"]["dynamic"] >= 1
    per_token = result["bytes_per_token"]
    assert per_token["quantized-4"] < per_token["quantized-8"] < per_token["dynamic"] == 16 * 1024  # bench-full, fp32
    assert result["agreement"]["dynamic"] == {"identical": 1.0, "prefix_share": 1.0}  # against itself
    assert len(result["targets"]) == 1


def test_weights_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.weights import FORMATS
    from benchmarks.weights import main as weights

    out = tmp_path / "weights.json"
    result = weights(["--tokens", "16", "--repeats", "1", "--replies", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["decode_tokens_per_s"]) == set(FORMATS)
    weight_bytes, state_bytes = result["weight_bytes"], result["state_bytes_per_token"]
    assert weight_bytes["bfloat16"] * 2 == weight_bytes["float32"]
    assert weight_bytes["int8"] < weight_bytes["float32"] / 2.5  # a byte a weight; embeddings stay fp32
    # packed: the same fp32 values (a tied output head becomes a packed copy of the embeddings)
    assert weight_bytes["float32"] <= weight_bytes["packed"] < weight_bytes["float32"] * 1.25
    assert state_bytes["bfloat16"] * 2 == state_bytes["float32"] == state_bytes["int8"] == state_bytes["packed"]
    assert set(result["agreement"]) == set(FORMATS) and result["agreement"]["float32"]["identical"] == 1.0
    assert len(result["targets"]) == len(FORMATS) - 1


def test_fairness_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.fairness import main as fairness

    out = tmp_path / "fairness.json"
    fairness(["--configs", "before,alone-fixed:32/128,32/128", "--stream-prompt", "300", "--long-prompt", "400",
              "--reply-tokens", "30", "--repeats", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert [run["config"] for run in result["runs"]] == ["before", "alone-fixed:32/128", "32/128"]
    assert len(result["targets"]) == 5
    for run in result["runs"]:
        stream, short_after_long = run["stream"], run["short_after_long"]
        assert stream["prompt_tokens"] >= 300 and short_after_long["prompt_tokens"] >= 400
        assert 0 < short_after_long["short_ttft_s"] and 0 < short_after_long["long_ttft_s"]
        assert run["long_beside_one_liners"]["one_liners_meanwhile"] >= 1
        assert run["newcomer_beside_streams"]["ttft_s"] > 0


def test_first_token_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.first_token import ARMS, main as first_token

    out = tmp_path / "first-token.json"
    first_token(["--model", "tiny-full", "--turns", "2", "--stream-tokens", "30", "--stream-prompt", "200", "--repeats",
                 "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert set(result["summary"]) == set(ARMS) and result["cpu_flags"]
    for arm in ARMS:
        summary = result["summary"][arm]
        assert summary["first_turn_ttft_s"] > 0 and summary["newcomer_ttft_s"] > 0
        assert summary["later_turns_prefilled_tokens"] > 0 and summary["stream_worst_over_median_alone"] > 0


def test_api_decode_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.api_decode import main as api_decode

    out = tmp_path / "api-decode.json"
    result = api_decode(["--model", "tiny-full", "--lengths", "60,120", "--new-tokens", "6", "--repeats", "2",
                         "--message-words", "30", "--json", str(out)])
    written = json.loads(out.read_text())
    assert written["cpu_flags"] and [row["prompt_tokens"] for row in written["lengths"]] == \
        [row["prompt_tokens"] for row in result["lengths"]]
    first, second = written["lengths"]
    assert 60 <= first["prompt_tokens"] < second["prompt_tokens"] and second["prompt_tokens"] >= 120
    for row in written["lengths"]:
        assert len(row["api_tokens_per_s"]) == len(row["bare_tokens_per_s"]) == 2
        assert min(row["api_tokens_per_s"] + row["bare_tokens_per_s"]) > 0
    assert written["targets"][0][1].endswith("x")


def test_outlier_channels_keep_the_fp32_function_and_the_exactness_run_holds(monkeypatch):
    """`benchmarks/exactness.py`: the outlier channels it puts in change the activations, not the
    fp32 model's logits (against the model before, a from-scratch forward each); one mode's run
    gives its replies and logit differences."""
    import torch

    from benchmarks import exactness
    from chat.loading import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer("demo", dtype="float32")
    ids = torch.tensor([list(range(20, 60))])
    with torch.no_grad():
        before = model(input_ids=ids).logits
        normed_before = model.model.layers[1].input_layernorm(model.model.embed_tokens(ids))
        exactness.add_outlier_channels(model)
        after = model(input_ids=ids).logits
        normed_after = model.model.layers[1].input_layernorm(model.model.embed_tokens(ids))
    assert normed_after.abs().amax() > 10 * normed_before.abs().amax()  # a few channels now dominate
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(exactness, "MAX_NEW", 8)
    result = exactness.run_mode("int8, outlier channels", None)
    assert result["replies"] == 25 and len(result["logit_diffs"]) == 5
    assert result["equal_to_scratch"] == 25  # greedy replies equal generate from scratch


def run_to_json(main, tmp_path, *args: str) -> dict:
    """A benchmark's `main` run with `args`, and the JSON it wrote."""
    out = tmp_path / "result.json"
    main([*args, "--json", str(out)])
    return json.loads(out.read_text())


def test_step_anatomy_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.step_anatomy import KINDS, main as step_anatomy

    result = run_to_json(step_anatomy, tmp_path, "--history", "40", "--prompt-history", "60", "--chunk", "4",
                         "--steps", "1", "--rounds", "2")
    assert set(result["median_step_ms"]) == set(KINDS) and all(ms > 0 for ms in result["median_step_ms"].values())
    assert {"four_rows_over_one", "own_forward_over_plain", "mixed_repeated_over_stacked", "targets"} <= set(result)


def test_compiled_step_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.compiled_step import MODES, main as compiled_step

    result = run_to_json(compiled_step, tmp_path, "--model", "tiny-full", "--history", "40", "--steps", "1",
                         "--rounds", "2", "--agree", "4")
    assert set(result["median_step_ms"]) == set(MODES) and all(ms > 0 for ms in result["median_step_ms"].values())
    assert result["graphs"] >= 1 and result["greedy_agreement"]["tokens"] == 4
    assert {"eager_over_compiled", "compile_s", "targets"} <= set(result)


def test_compiled_step_benchmark_saves_its_graph_and_a_second_run_loads_it(tmp_path):
    from benchmarks.compiled_step import main as compiled_step

    arguments = ("--model", "tiny-full", "--history", "40", "--steps", "1", "--rounds", "2", "--agree", "4",
                 "--store", str(tmp_path / "steps"))
    first = run_to_json(compiled_step, tmp_path, *arguments)
    restarted = run_to_json(compiled_step, tmp_path, *arguments)
    assert first["rows_loaded"] == [] and restarted["rows_loaded"] == [1] and restarted["graphs"] == 1
    assert restarted["greedy_agreement"]["equal_before_first_difference"] == 4  # same tokens as eager


def test_restart_benchmark_times_a_first_start_and_a_restart_in_processes_of_their_own(tmp_path):
    from benchmarks.restart import STARTS, main as restart

    result = run_to_json(restart, tmp_path, "--model", "tiny-full", "--cache", str(tmp_path / "cache"))
    assert list(result["starts"]) == list(STARTS)
    first, again = result["starts"]["first"], result["starts"]["restart"]
    assert first["compiled_step"]["rows_loaded"] == [] and again["compiled_step"]["rows_loaded"] == [1]
    for row in (first, again):
        assert row["compiled_step"]["ready"] and 0 < row["engine_s"] <= row["one_row_s"] <= row["all_rows_s"]
    assert len(result["targets"]) == 2


def test_parallel_loads_benchmark_writes_the_documented_fields(tmp_path):
    """Through a launched app with a small bound: six 2 MB loads at once from one client, two of
    the largest (3 MB) at most waiting: some are refused before they are read, the others answered,
    and another user's load is answered meanwhile."""
    from benchmarks.parallel_loads import main as parallel_loads

    result = run_to_json(parallel_loads, tmp_path, "--loads", "6", "--mb", "2", "--app-args", "--max-request-mb 3")
    assert {"idle_mb", "peak_mb", "after_mb", "peak_over_idle_mb", "after_over_idle_mb", "refused", "statuses",
            "slowest_load_s", "other_user_load_s"} <= set(result)
    assert len(result["statuses"]) == 6 and set(result["statuses"]) <= {200, 429, 503, -1}
    assert 200 in result["statuses"] and result["other_user_status"] == 200


def test_past_context_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.past_context import main as past_context

    result = run_to_json(past_context, tmp_path, "--model", "tiny-full", "--turns", "12", "--context", "512",
                         "--message-tokens", "60", "--reply-tokens", "8")
    moving, kept = result["runs"]
    assert (moving["share"], kept["share"]) == (1.0, 0.5)
    for row in result["runs"]:
        assert row["answered"] and row["turns_past_context"] >= 5 and len(row["per_turn"]) == row["turns_past_context"]
    # prompt tokens, not time: the kept cut prefills less than a cut moved every turn
    assert kept["mean_prefilled"] < 0.5 * moving["mean_prefilled"]


def test_prepare_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.prepare import main as prepare

    result = run_to_json(prepare, tmp_path, "--model", "tiny-full", "--message", "200", "--typed-chars", "12",
                         "--chars-per-s", "20", "--send-after-ms", "300,0", "--reply-tokens", "30", "--repeats", "1")
    assert result["prepared"]["prepared_prefilled"] == 0 and result["prepared"]["message_tokens"] > 150
    assert set(result["typed"]) == {"send_after_300_ms", "send_after_0_ms"}
    for case in result["typed"].values():
        assert {"typed_ttft_s", "typed_over_decode_step", "typed_prefilled"} <= set(case)
        assert len(case["runs_over_decode_step"]) == 1
    assert {"median_gap_alone_s", "worst_gap_typists_s", "worst_over_worst_alone"} <= set(result["typists"])


def test_the_benchmarks_typist_asks_when_the_page_would():
    """`page_asks` stands for ui/page_assets.py's rule: at most every PREPARE_EVERY_MS, with the
    text as it stands when the ask fires, the last keystroke's always asked for."""
    from benchmarks.prepare import page_asks
    from ui.page_assets import PAGE_SCRIPT, PREPARE_EVERY_MS

    assert f"preparedAt + {PREPARE_EVERY_MS} - Date.now()" in PAGE_SCRIPT
    every = PREPARE_EVERY_MS / 1000
    slow = [index * (every + 0.05) for index in range(5)]  # slower than the rule: each keystroke, at once
    assert page_asks(slow) == [(pytest.approx(at + 0.02), index + 1) for index, at in enumerate(slow)]
    fast = [index * 0.007 for index in range(100)]  # faster: one ask every `every`, then the last
    asks = page_asks(fast)
    assert [at for at, _ in asks] == pytest.approx([0.02 + index * every for index in range(len(asks))])
    assert asks[-1] == (pytest.approx(asks[-2][0] + every), 100) and asks[-2][0] < fast[-1] <= asks[-1][0]
    assert [typed for _, typed in asks] == [min(100, int(at / 0.007) + 1) for at, _ in asks]


def test_retry_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.retry import ARMS, main as retry

    result = run_to_json(retry, tmp_path, "--model", "tiny-full", "--turns", "1", "--message", "40", "--retries", "1",
                         "--repeats", "2")
    assert set(result["summary"]) == set(ARMS) and all(len(runs) == 2 for runs in result["runs"].values())
    # the arms are what they say: the prompt's last token fed again, or nothing fed
    assert result["summary"]["fed again"]["retry_prefilled_tokens"] == 1
    assert result["summary"]["kept"]["retry_prefilled_tokens"] == 0


def test_drafting_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.drafting import SCENARIOS, main as drafting

    result = run_to_json(drafting, tmp_path, "--model", "tiny-full", "--tokens", "12", "--repeats", "1")
    assert set(result["table"]) == set(SCENARIOS) and result["cpu_flags"]
    for scenario, row in result["table"].items():
        assert row["same_reply"], scenario  # greedy, or seeded sampling: the same reply in every mode
        assert set(row["tokens_per_s"]) == {"off", "ngram", "auto"}
    # tokens, not time: a greedy Retry takes its earlier version's tokens as guesses, several a step
    assert result["table"]["retry"]["taken_over_guessed"]["ngram"] == 1.0
    assert result["table"]["retry"]["tokens_per_step"]["ngram"] > 2


def test_prompt_kernels_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.prompt_kernels import main as prompt_kernels

    result = run_to_json(prompt_kernels, tmp_path, "--model", "tiny-full", "--prompt", "40", "--repeats", "1",
                         "--peak-size", "256")
    assert set(result["prefill_ms"]) == {"fp32-model", "int8/fp32", "int8/bf16"}
    assert result["engine_chose"]["chosen"] in ("fp32", "bf16") and result["kernels_logit_max_difference"] >= 0
    assert result["peak_size"] == 256 and set(result["peak_gflops_square_matmul"]) == {"fp32", "bf16"}


def test_cold_start_benchmark_times_replies_while_the_graph_builds(tmp_path):
    from benchmarks.cold_start import main as cold_start

    result = run_to_json(cold_start, tmp_path, "--model", "tiny-full", "--ways", "yield", "--tokens", "4")
    run = result["runs"]["yield"][0]
    assert run["compile_priority"] == "nice 19" and run["compile_s"] > 0 and run["eager_tokens_per_s"] > 0
    assert {"during_over_eager", "compiled_over_eager"} <= set(result["median"]["yield"]) and result["targets"]


def test_newcomer_benchmark_writes_the_documented_fields(tmp_path):
    from benchmarks.newcomer import ARMS, main as newcomer

    result = run_to_json(newcomer, tmp_path, "--model", "tiny-full", "--reply-tokens", "40", "--repeats", "2")
    assert set(result["summary"]) == set(ARMS) and all(len(runs) == 2 for runs in result["runs"].values())
    for name in ARMS:
        assert {"ttft_s", "idle_ttft_s", "over_idle", "steps_apart", "streams_worst_gap_near_over_median"} <= set(
            result["summary"][name])
    assert all(run["steps_apart"] == 0 for run in result["runs"]["beside"])  # the arm is what it says
