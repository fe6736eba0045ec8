"""What the app does about Gradio's own costs while a reply streams (ui/gradio_tuning.py), and a
page load that copies no model (see docs/performance.md, "Through the web")."""

import asyncio
import urllib.request

import gradio as gr
import httpx
import torch
from gradio import networking
from gradio.state_holder import SessionState

from ui import gradio_tuning


def test_serving_the_page_copies_no_part_of_the_model(make_engine, monkeypatch):
    """Gradio deep-copies the components' config for every page it serves; a bound method in it
    (a State's delete_callback) once took the directory, the engine and the model's weights along,
    on a request thread, whose use of torch's thread pool slowed decoding down for good."""
    import app
    from ui.directory import ChatDirectory
    from ui.handlers import ChatHandlers

    engine = make_engine("full")
    demo = app.build(ChatHandlers(engine, ChatDirectory(engine)), model_label="test", max_new_tokens=16)
    copied = []
    original = torch.Tensor.__deepcopy__

    def counting(self, memo):
        copied.append(tuple(self.shape))
        return original(self, memo)

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", counting)
    demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        with urllib.request.urlopen(demo.local_url, timeout=30) as page:
            assert page.status == 200
    finally:
        demo.close()
    assert copied == []


def postprocessed(demo: gr.Blocks, values: list) -> tuple[list, list]:
    """What the page receives, and what the session keeps of its States."""
    state = SessionState(demo)
    outputs = asyncio.run(demo.postprocess_data(demo.fns[0], values, state))
    kept = [state[block._id] if block._id in state else "(unset)" for block in demo.fns[0].outputs if block.stateful]
    return outputs, kept


def test_a_skipped_output_reaches_the_page_as_gradio_sends_it_without_building_a_component(monkeypatch):
    with gr.Blocks() as demo:
        chat, send, stop, stats = gr.Chatbot(), gr.Button("Send"), gr.Button("Stop", visible=False), gr.Markdown()
        key = gr.State()
        send.click(lambda: None, None, [chat, send, stop, stats, key])
    cases = [
        [[{"role": "user", "content": "hi"}], gr.skip(), gr.skip(), gr.skip(), gr.skip()],
        [[{"role": "user", "content": "hi"}], gr.update(visible=False), gr.update(visible=True), "**busy**", "k"],
        [gr.skip(), gr.skip(), gr.skip(), "only the stats", gr.skip()],
        [gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()],
    ]
    monkeypatch.setattr(gr.blocks.Blocks, "postprocess_data", gradio_tuning._original_postprocess)
    expected = [postprocessed(demo, case) for case in cases]

    monkeypatch.setattr(gr.blocks.Blocks, "postprocess_data", gradio_tuning._original_postprocess)
    gradio_tuning.pass_skipped_outputs_through()
    built = []
    original_init = gr.Button.__init__

    def counting(self, *args, **kwargs):
        built.append(1)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(gr.Button, "__init__", counting)
    assert [postprocessed(demo, case) for case in cases] == expected
    assert len(built) == 2  # only the two buttons the second case changes (Gradio alone builds 8)


def test_the_queue_is_polled_gently():
    with gr.Blocks() as demo:
        gr.Button()
    demo.queue()
    gradio_tuning.poll_queue_every(demo, 0.01)
    assert demo._queue.sleep_when_free == 0.01


def test_a_slow_first_answer_to_gradios_start_check_does_not_end_the_start(monkeypatch):
    """Gradio's launch asks its page once (3 s); a timeout made it raise and the app exit on a busy
    host. Patient: asked again until it answers, and a page that never answers still fails."""
    answers: list = []

    def head(url, **kwargs):
        answer = answers.pop(0) if answers else httpx.TimeoutException("no answer")
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(networking.httpx, "head", head)
    monkeypatch.setattr(networking, "url_ok", networking.url_ok)  # Gradio's own again after the test
    gradios_own = networking.url_ok
    answers[:] = [httpx.TimeoutException("slow"), type("Answer", (), {"status_code": 200})()]
    assert not gradios_own("http://127.0.0.1:9/")  # gives up at the first timeout
    answers[:] = [httpx.TimeoutException("slow"), httpx.TimeoutException("slow"),
                  type("Answer", (), {"status_code": 200})()]
    gradio_tuning.patient_start_check(seconds=60)
    assert networking.url_ok("http://127.0.0.1:9/") and answers == []
    networking.url_ok = gradios_own
    gradio_tuning.patient_start_check(seconds=0.3)
    assert not networking.url_ok("http://127.0.0.1:9/")
