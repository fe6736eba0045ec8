"""The terminal chat (`python -m chat`): commands, and Ctrl+C stops a reply without exiting."""

import os
import signal
import subprocess
import sys
import time

from app_server import ROOT


def run_chat(folder, lines: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chat", "--model", str(folder), "--temperature", "0",
                           "--max-new-tokens", "8"], input=lines, capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def thread_dump(pid: int) -> str:
    """Every thread's Python stack of a running process (py-spy, where installed)."""
    import shutil

    if shutil.which("py-spy") is None:
        return "(py-spy not installed)"
    result = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
    return result.stdout + result.stderr


def saved_model(tmp_path, base_tokenizer, eos: bool = True):
    from tiny_models import build_model

    model = build_model("full", len(base_tokenizer), base_tokenizer.convert_tokens_to_ids("<|im_end|>"))
    if not eos:
        model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    base_tokenizer.save_pretrained(tmp_path)
    return tmp_path


def test_commands_work_and_help_is_not_sent_to_the_model(tmp_path, base_tokenizer):
    folder = saved_model(tmp_path, base_tokenizer)
    result = run_chat(folder, "/help\nHello there\n/regen\n/version 1\n/history\n/edit 0 Edited\n/continue\n"
                              "/undo\n/bogus\n/edit x\n/version 0\n/new\n/quit\n")
    out = result.stdout
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert "/regen" in out and "/edit N text" in out  # the help list, printed locally
    assert "0 user: Hello there" in out and "(version 1 of 2)" in out
    assert "from the cache" in out and "(undone)" in out and "(a new conversation)" in out
    assert "unknown command /bogus" in out and "/edit takes the number /history shows" in out
    assert "/version takes a version number, from 1" in out and "branch -1" not in out


def test_ctrl_c_stops_the_reply_and_a_second_one_exits(tmp_path, base_tokenizer):
    import threading

    folder = saved_model(tmp_path, base_tokenizer, eos=False)
    process = subprocess.Popen([sys.executable, "-m", "chat", "--model", str(folder), "--temperature", "0",
                                "--max-new-tokens", "1900"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                               # Ctrl+C as a terminal gives it, even where pytest was started in the background
                               # (a shell's `&` ignores SIGINT, the child inherits that and Python then keeps it)
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out: list[str] = []
    threading.Thread(target=lambda: out.extend(iter(lambda: process.stdout.read(1), "")), daemon=True).start()

    def wait_for(condition, timeout_s=60.0):
        deadline = time.monotonic() + timeout_s
        while not condition("".join(out)):
            assert time.monotonic() < deadline, "".join(out)[-500:]
            time.sleep(0.05)

    wait_for(lambda text: "you> " in text)
    process.stdin.write("Talk forever.\n")
    process.stdin.flush()
    wait_for(lambda text: len(text.split("you> ", 1)[1]) > 200)  # the reply is streaming
    process.send_signal(signal.SIGINT)
    wait_for(lambda text: "[prompt:" in text)  # stopped: its stats line, then the prompt again
    process.stdin.write("/history\n")
    process.stdin.flush()
    # the history written and the prompt back (a Ctrl+C seen mid-history exits too, but this is the prompt's)
    wait_for(lambda text: "1 assistant:" in text and text.rstrip(" ").endswith("you>"))
    process.send_signal(signal.SIGINT)  # at the prompt: exit
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:  # say where it is stuck (and what it printed to stderr), then fail
        dump = thread_dump(process.pid)
        process.kill()
        raise AssertionError(f"no exit 60 s after Ctrl+C; its threads:\n{dump}\nstderr:\n"
                             f"{process.stderr.read()[-3000:]}") from None
    assert process.returncode == 0, process.stderr.read()
    assert "stopped" in "".join(out) and "Traceback" not in process.stderr.read()


def test_a_message_typed_in_the_terminal_is_prepared_before_its_send(make_engine, capsys):
    """The terminal prepares the line being typed, as the page does (at most every 150 ms,
    the text as it stands, on a thread of its own): once the last text typed is prepared, its
    Send computes at most the prompt's last token. Keys go through prompt_toolkit's own pipe."""
    import threading

    from prompt_toolkit import PromptSession
    from prompt_toolkit.input import create_pipe_input
    from prompt_toolkit.output import DummyOutput

    from chat import GenerationOptions
    from chat.__main__ import TerminalChat
    from chat.typing_ahead import line_reader

    engine = make_engine("full")
    chat = TerminalChat(engine, "You are terse.", GenerationOptions(max_new_tokens=4, do_sample=False))
    asked: list[str] = []

    def prepare(text: str) -> None:
        chat.conv.prepare(text, fit_context=True, **chat._options())
        asked.append(text)  # after its draft was queued: none left means it was prefilled

    typed, read = "What is 2 + 2, and why?", {}
    with create_pipe_input() as keys:
        reader = line_reader("you> ", prepare, PromptSession(input=keys, output=DummyOutput()))
        thread = threading.Thread(target=lambda: read.update(line=reader()), daemon=True)
        thread.start()
        for character in typed:
            keys.send_text(character)
        wait_until(lambda: asked[-1:] == [typed] and engine.batch_stats().preparing == 0)
        keys.send_text("\r")
        thread.join(30)
    assert read["line"] == typed and len(asked) <= len(typed)
    assert chat.handle(read["line"])
    stats = chat.conv.stats
    assert stats.prompt_tokens > 10 and stats.prefilled_tokens <= 1, stats
    assert "from the cache" in capsys.readouterr().out


def test_commands_are_not_prepared_and_no_ask_runs_after_close():
    from chat.typing_ahead import TypingAhead

    asked: list[str] = []
    ahead = TypingAhead(asked.append, every_s=0.0)
    for text in ("/edit 0 Hello", "  ", "Hello"):
        ahead.typed(text)
        wait_until(lambda: ahead._text is None)  # taken by its thread
    wait_until(lambda: asked == ["Hello"])
    ahead.close()
    ahead.typed("Hello again")  # the line was sent: nothing more
    assert asked == ["Hello"] and ahead.asked == 1


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
