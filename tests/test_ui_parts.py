"""The app's parts without a server: flags and environment, the browser directory, named I/O."""

import re

import gradio as gr
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chat import EngineConfig, ServerBusyError
from ui.config import AppConfig
from ui.directory import ChatDirectory
from ui.outputs import ChatOutputs, Settings


def test_flags_win_over_environment_which_wins_over_defaults():
    assert AppConfig.from_args([], environ={}) == AppConfig()
    assert AppConfig().max_checkpoints == EngineConfig().max_checkpoints  # one default, read from the engine's
    from_env = AppConfig.from_args([], environ={"MAX_SESSIONS": "7", "GRADIO_SERVER_PORT": "9000"})
    assert (from_env.max_sessions, from_env.port) == (7, 9000)
    flagged = AppConfig.from_args(["--max-sessions", "3", "--cache-budget-mb", "1.5"], environ={"MAX_SESSIONS": "7"})
    assert (flagged.max_sessions, flagged.cache_budget_mb) == (3, 1.5)


def test_settings_and_outputs_are_bound_by_name():
    settings = Settings(temperature=0.0, max_new_tokens=9)
    assert Settings.from_values(tuple(settings.values())) == settings
    options = settings.options()
    assert (options.do_sample, options.temperature, options.max_new_tokens) == (False, None, 9)
    assert ChatOutputs(key="k", stats="s").to_gradio()[ChatOutputs.names().index("stats")] == "s"
    with pytest.raises(gr.Error, match="settings: expected 7 values"):
        Settings.from_values(("only one",))


def test_a_page_is_forgotten_when_its_conversation_expires(make_engine):
    directory = ChatDirectory(make_engine("full"), idle_timeout_s=0.0)
    key, chat, notice = directory.chat(None, "System.", page="page-1")
    assert directory.pages() == 1 and notice is None
    assert directory.find(key) is None  # idle longer than 0 s: expired on the next look-up
    assert directory.pages() == 0


def test_a_new_system_prompt_is_a_new_branch_of_the_same_conversation(make_engine):
    directory = ChatDirectory(make_engine("full"))
    key, chat, _ = directory.chat(None, "First.", page="page-1")
    list(chat.conversation.send("hi", max_new_tokens=2, do_sample=False))
    first = chat.conversation.messages
    same_key, same, notice = directory.chat(key, "Second.", page="page-1")
    assert same_key == key and same is chat and "system prompt changed" in notice
    assert chat.conversation.messages == [{"role": "system", "content": "Second."}]
    assert chat.conversation.switch_branch(0, 0) and chat.conversation.messages == first  # nothing lost
    directory.page_closed("page-1")
    assert key not in directory.manager and directory.pages() == 0


def test_a_full_server_says_so_in_the_one_error_family(make_engine):
    directory = ChatDirectory(make_engine("full"), max_sessions=1)
    key, chat, _ = directory.chat(None, "")
    with chat.conversation.exclusive():  # an operation runs: busy
        with pytest.raises(ServerBusyError):
            directory.chat(None, "")


def test_the_stats_line_speaks_plainly_and_keeps_details_a_click_away():
    from chat import TurnStats
    from ui import views

    stats = TurnStats(reused_tokens=601, prefilled_tokens=11, generated_tokens=64, rebuilt=False, ttft_s=0.027,
                      decode_tokens_per_s=20.4, cache_tokens=857, cache_bytes=int(1.6 * 2**20), prompt_tokens=612,
                      rollback="crop", waited_s=0.0)
    line = views.stats_line(stats)
    visible, details = line.split("<details>")
    assert "601 of 612 tokens from the cache" in visible and "**11 computed**" in visible
    assert "first token after **27 ms**" in visible and "**20 tokens/s**" in visible and "waiting" not in visible
    assert "857 tokens" in details and "crop" in details
    waited = views.stats_line(TurnStats(**{**stats.__dict__, "ttft_s": 1.9, "waited_s": 1.85}))
    assert "first token after **1900 ms** (1850 ms of it waiting for other replies)" in waited


def test_a_reply_says_which_version_it_is_and_whether_it_was_stopped():
    from chat.dialogue.history import History, ReplyVersion
    from ui import views

    tree = History()

    def version(text, stopped=False):  # a reply not stopped ended with the model's end token
        return tree.node("assistant", reply=ReplyVersion(text, "", [1], [2], False, stopped, ended=not stopped))

    question = tree.node("user", "Q1")
    question.add_child(version("A"))
    question.add_child(version("B", stopped=True))
    later = question.shown_child.add_child(tree.node("user", "Q2"))
    entries = [question, question.shown_child, later, later.add_child(version("C"))]
    shown, index_of = views.chatbot_messages([e.message() for e in entries], {}, views.reply_marks(entries),
                                             views.branch_navs(entries))
    assert shown[2]["content"] == "B\n\n<sub>stopped</sub>"
    switcher = shown[1]["content"]  # a message of its own above the reply: ‹ 2 / 2 › and ↻ (an earlier reply)
    assert re.search(r'class="branch-step prev bs-1-0"[^>]*><span class="sr-only">Previous branch<', switcher)
    assert re.search(r'class="branch-step next bs-1-2"[^>]* disabled><span class="sr-only">Next branch<', switcher)
    assert "2 / 2</span>" in switcher and index_of[1] is None
    assert re.search(r'class="branch-step regen br-1"[^>]*><span class="sr-only">Retry this reply<', switcher)
    assert shown[4]["content"] == "C" and len(shown) == 5  # the last reply, one version, not stopped: nothing


def test_a_revision_is_never_written_past_what_the_browser_holds_exactly():
    """A record at revision 2^53 - 1 (forged: one write a revision) would be written back as 2^53,
    which the browser's doubles cannot tell from 2^53 + 1: it is refused as malformed; the largest
    one taken is written back as 2^53 - 1, exact."""
    from ui.browser_copy import Book, checked_record

    record = {"id": "revisions1", "rev": 2**53 - 1, "title": "t", "data": {}}
    assert checked_record(record) is None
    record["rev"] = 2**53 - 2
    book = Book()
    book.read(checked_record(record))
    assert book.next_rev("revisions1") == 2**53 - 1 == float(2**53 - 1)


def test_a_reply_of_thinking_only_says_no_answer_came_and_the_busy_box_invites_typing():
    """A reply that was only a folded Thinking block showed nothing else; the message box
    during a reply said to stop first, though typing ahead works."""
    from ui import views

    messages = [{"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "", "reasoning_content": "Let me think."}]
    shown, index_of = views.chatbot_messages(messages, {})
    assert [m.get("metadata", {}).get("title") for m in shown] == [None, views.THINKING_TITLE, None]
    assert views.NO_ANSWER in shown[-1]["content"] and index_of == [0, 1, None]  # the note: nothing to edit
    answered = messages[:1] + [{"role": "assistant", "content": "Hello.", "reasoning_content": "Let me think."}]
    assert all(views.NO_ANSWER not in m["content"] for m in views.chatbot_messages(answered, {})[0])
    assert "Stop" not in views.BUSY and "sends it when this reply ends" in views.BUSY


def test_a_reply_stopped_while_thinking_shows_its_mark_under_the_fold_and_can_go_on():
    """Stopped (or its length ran out) before any answer: the mark ("stopped") and Continue's class
    sit on a message of their own under the folded Thinking block, the last message shown (the page
    enables Continue from it); before, they were inside the folded block and Continue stayed off."""
    from ui import views

    messages = [{"role": "user", "content": "What is 5 * 67?"},
                {"role": "assistant", "content": "", "reasoning_content": "5 * 67 is"}]
    shown, index_of = views.chatbot_messages(messages, {1: 0.4}, marks={1: "stopped"}, continuable={1})
    assert shown[1].get("metadata", {}).get("title") == views.THINKING_TITLE
    assert "stopped" not in shown[1]["content"]
    assert shown[-1]["content"] == f'{views.CONTINUABLE_MARK_OPEN}stopped{views.MARK_CLOSE}' and index_of == [0, 1, 1]
    assert views.without_mark(shown[-1]["content"]) == ""  # an edit of it starts from the empty answer


def test_only_a_reply_the_model_did_not_end_is_marked_for_continue_and_the_mark_is_not_its_text(tokenizers):
    """The page enables Continue from the class on the last reply's note."""
    from conftest import THINKING_TEMPLATE
    from tiny_models import scripted_reply_model

    from chat import ChatEngine
    from ui import views

    tokenizer = tokenizers[THINKING_TEMPLATE]
    engine = ChatEngine(scripted_reply_model(tokenizer, "Done."), tokenizer)
    conversation = engine.conversation()
    list(conversation.send("Finish, please.", max_new_tokens=32, enable_thinking=False))  # ends with its end token
    list(conversation.send("And again, cut short.", max_new_tokens=2, enable_thinking=False))  # its length runs out
    shown, _ = views.path_messages(conversation.history.entries)
    finished, cut = shown[1]["content"], shown[-1]["content"]
    assert "continuable" not in finished and "<sub" not in finished
    assert cut.endswith(f'<sub class="continuable">{views.UNFINISHED}</sub>')
    assert views.without_mark(cut) == conversation.messages[-1]["content"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("ab 1.#-+=*_`[](){}<>&;!|~$\\\t\n") + ["&nbsp;", "&amp;", "&lt;", "&Tab;"]),
                max_size=40).map("".join))
def test_a_persons_message_is_shown_as_typed_and_an_edit_gets_it_back(text):
    """What `as_typed` makes of a message gives the message back (an edit starts
    from it), and holds no character Markdown, HTML or math would act on unescaped."""
    from ui import views

    shown = views.as_typed(text)
    assert views.typed_text(shown) == text
    assert not set(shown) & set("<>*_`[]|~$\\")  # each such character went as a reference
    assert not re.search(r"^[ \t]*(?:[#+\-=]|\d+[.)])", shown, re.M)  # nor a line's heading or list mark
