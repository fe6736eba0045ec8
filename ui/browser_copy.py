"""The copy of its conversations each browser keeps: one record per conversation, merged by revision.

The browser holds the records (localStorage, written by `SCRIPT`); the server holds caches only,
and per page a `Book` (`gr.State`) of which record the page shows and at which revision. What
travels per event is what changed: down, the records an event changed (`outbox`); up, the shown
record's id and revision (`probe`), and a whole record only when the server must rebuild a
conversation from it (a reload, a restart, an expiry, another tab changed it) or a page opens one.

  record     {"id", "rev", "title", "renamed", "data": Conversation.to_dict(), "draft"}
  tombstone  {"id", "rev", "deleted": true}       (a delete: other tabs must not bring it back)
  rename     {"id", "rev", "title", "renamed"}    (the stored data kept)
  reply      {"id", "rev", "draft": true, "reply"} (the streaming reply so far: its draft's last message)

The browser adds "tab" and "updated". It writes a record when it holds none of that id, an older
revision, or its own draft of the same revision (a draft is the reply so far: written while it
streams, replaced by the final record). Another tab's record of the same or a newer revision is
never overwritten: the incoming one is kept under a new id and this tab goes on with that copy
(the next probe says so: `moved`). A draft never displaces anything; a write no newer than a
tombstone is dropped (a tab that goes on in a deleted conversation writes it again, newer). Nothing the browser sends
is trusted: records are checked here, their conversations as an Import (`engine.restore`).
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from chat.dialogue import saved
from chat.storage.shares import is_share_id

MAX_CHATS = 50
MAX_TITLE_CHARS = 80
MAX_NOTICES = 5
_ID = re.compile(r"[A-Za-z0-9_-]{8,40}")


@dataclass
class Book:
    """What the server knows, per page, of its browser's copy."""

    current: str | None = None  # the record the page shows (made here when a new chat starts)
    revs: dict[str, int] = field(default_factory=dict)  # each record's revision as this page last read or wrote it
    parked: dict[str, str] = field(default_factory=dict)  # record id -> server key of a conversation left shown
    index: list[tuple[str, str]] = field(default_factory=list)  # (id, title), newest first: the list shown
    renamed: set[str] = field(default_factory=set)  # ids whose name the user chose
    saved: tuple[str, int] | None = None  # (server key, conversation revision) the shown record was written from
    copied: dict[str, int] = field(default_factory=dict)  # record id -> revision of this page's latest copy of a streaming reply
    account: str | None = None  # signed in: the account its records are kept for too (from the OAuth session)
    unclaimed: list[str] = field(default_factory=list)  # signed in: this browser's chats the account lacks (at load)

    def title(self, chat_id: str | None) -> str:
        return next((title for entry, title in self.index if entry == chat_id), "")

    def new_entry(self, title: Any = None) -> str:
        """A new record's id; named `title` (checked) if it has one: a name chosen, as a rename's,
        not taken from its first message (an imported, shared or branched-off conversation)."""
        chat_id = new_id()
        if title := checked_title(title):
            self.renamed.add(chat_id)
            self.put_first(chat_id, title)
        return chat_id

    def put_first(self, chat_id: str, title: str) -> None:
        self.index = [(chat_id, title)] + [(entry, name) for entry, name in self.index if entry != chat_id]
        del self.index[MAX_CHATS:]

    def forget(self, chat_id: str) -> None:
        self.index = [(entry, name) for entry, name in self.index if entry != chat_id]
        self.revs.pop(chat_id, None)
        self.copied.pop(chat_id, None)
        self.renamed.discard(chat_id)

    def hear(self, said: "Probe") -> list[str]:
        """What the page said besides its event: copies its tab kept of records another tab had
        changed (this page goes on with its copy), the list, refused writes. Returns what to tell
        the person."""
        if self.current is not None and said.current is not None and said.moved.get(self.current) == said.current:
            self.revs[said.current], self.current = 1, said.current
            self.parked.pop(said.current, None)
        if said.index is not None:
            self.index = said.index
            self.renamed &= {entry for entry, _ in said.index}
        notices = [f"This browser keeps {MAX_CHATS} conversations: the oldest, “{title}”, was removed from the list."
                   for title in said.notices]
        if said.full:
            notices.append("This browser's storage is full: the latest changes are not kept in it. Export or delete "
                           "some conversations.")
        return notices

    def read(self, record: dict[str, Any], saved: tuple[str, int] | None = None) -> None:
        """This page now knows `record` at its revision (`saved`: the server key and revision of
        the conversation made of it, if one was)."""
        self.revs[record["id"]] = record["rev"]
        if record["renamed"]:
            self.renamed.add(record["id"])
        if all(entry != record["id"] for entry, _ in self.index):
            self.put_first(record["id"], record["title"])
        self.saved = saved

    def next_rev(self, chat_id: str) -> int:
        """The revision the next write of `chat_id` carries (and this page then knows)."""
        self.revs[chat_id] = self.revs.get(chat_id, 0) + 1
        return self.revs[chat_id]


def checked_book(value: Any) -> Book:
    """The page's book (a `gr.State`: the server's own), or a new one."""
    return value if isinstance(value, Book) else Book()


def new_id() -> str:
    return secrets.token_urlsafe(12)


def checked_id(value: Any) -> str | None:
    return value if isinstance(value, str) and _ID.fullmatch(value) else None


MAX_REV = 2**53 - 1  # the browser's numbers are doubles: the largest integer all of them hold exactly


def checked_rev(value: Any) -> int | None:
    """A revision this page can write the next of (`Book.next_rev`) and the browser still hold exactly."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_REV else None


def checked_title(value: Any) -> str:
    return " ".join(value.split())[:MAX_TITLE_CHARS] if isinstance(value, str) else ""


@dataclass
class Probe:
    """What the page says before an event: the record it shows (as its tab knows it), copies its
    tab made of records another tab had changed, and whether the browser refused a write."""

    current: str | None = None
    rev: int | None = None  # None: the browser holds no record of `current` (a new chat, or deleted)
    moved: dict[str, str] = field(default_factory=dict)
    full: bool = False
    notices: list[str] = field(default_factory=list)
    index: list[tuple[str, str]] | None = None  # the list (on load and when another tab changed it)
    record: dict[str, Any] | None = None  # the shown record (on load, opening one, rebuilding one)
    pending_prompt: tuple[str, str] | None = None  # (record id, text): a system prompt typed, not applied (on load)
    share: str | None = None  # a shared link's id, from the address (on load: "Continue in a new chat")
    revs: dict[str, int] = field(default_factory=dict)  # every record's id and revision, tombstones too (on load)


def checked_probe(value: Any) -> Probe:
    """Anything malformed left out (a probe is small: bounded before it is looked at)."""
    if not isinstance(value, dict) or saved.nests_deeper(value, saved.MAX_NESTING + 2):
        return Probe()
    moved = value.get("moved") if isinstance(value.get("moved"), dict) else {}
    notices = value.get("notices") if isinstance(value.get("notices"), list) else []
    return Probe(current=checked_id(value.get("current")), rev=checked_rev(value.get("rev")),
                 moved={old: new for old, new in list(moved.items())[:MAX_CHATS]
                        if checked_id(old) and checked_id(new)},
                 full=value.get("full") is True,
                 notices=[checked_title(text) for text in notices[:MAX_NOTICES] if isinstance(text, str)],
                 index=checked_index(value["index"]) if "index" in value else None,
                 record=checked_record(value.get("record")),
                 pending_prompt=checked_pending(value.get("pending")),
                 share=value["share"] if is_share_id(value.get("share")) else None,
                 revs=checked_revs(value.get("revs")))


def checked_revs(value: Any) -> dict[str, int]:
    """The browser's record ids and revisions (it keeps MAX_CHATS and their tombstones: a few more)."""
    items = list(value.items())[:4 * MAX_CHATS] if isinstance(value, dict) else []
    return {chat_id: rev for chat_id, rev in items if checked_id(chat_id) and checked_rev(rev) is not None}


def checked_pending(value: Any) -> tuple[str, str] | None:
    """The system prompt this tab typed for a record and has not applied yet (its length is
    checked where it is used, against the server's limit)."""
    if not isinstance(value, dict) or not isinstance(value.get("text"), str):
        return None
    chat_id = checked_id(value.get("id"))
    return (chat_id, value["text"]) if chat_id else None


def checked_index(value: Any) -> list[tuple[str, str]]:
    index: list[tuple[str, str]] = []
    for entry in value[:MAX_CHATS] if isinstance(value, list) else []:
        if isinstance(entry, list) and len(entry) == 2 and (chat_id := checked_id(entry[0])) \
                and all(chat_id != seen for seen, _ in index):
            index.append((chat_id, checked_title(entry[1]) or "New chat"))
    return index


def checked_record(value: Any) -> dict[str, Any] | None:
    """A live record with its fields in shape (its conversation is checked when it is opened)."""
    if not isinstance(value, dict) or value.get("deleted") or saved.nests_deeper(value, saved.MAX_NESTING + 1):
        return None
    chat_id, rev = checked_id(value.get("id")), checked_rev(value.get("rev"))
    if chat_id is None or rev is None or not isinstance(value.get("data"), dict):
        return None
    return {"id": chat_id, "rev": rev, "title": checked_title(value.get("title")),
            "renamed": value.get("renamed") is True, "data": value["data"]}


def record(book: Book, chat_id: str, data: dict[str, Any], *, draft: bool = False) -> dict[str, Any]:
    """The record of `data` to write: the next revision (a draft carries the revision its final
    record will have, and this page does not count it as written)."""
    title = book.title(chat_id) if chat_id in book.renamed else title_of(data)
    rev = book.revs.get(chat_id, 0) + 1 if draft else book.next_rev(chat_id)
    if draft:
        book.copied[chat_id] = rev
    else:
        book.put_first(chat_id, title)
    return {"id": chat_id, "rev": rev, "title": title, "renamed": chat_id in book.renamed, "data": data,
            "draft": draft}


def reply_patch(draft: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    """The streaming reply's message so far, for the browser's copy of `draft` (its last message):
    a few kilobytes with each update of the chat, not the whole conversation again."""
    return {"id": draft["id"], "rev": draft["rev"], "draft": True, "reply": reply}


def tombstone(book: Book, chat_id: str) -> dict[str, Any]:
    rev = book.next_rev(chat_id)
    book.forget(chat_id)
    return {"id": chat_id, "rev": rev, "deleted": True}


def rename(book: Book, chat_id: str, title: str) -> dict[str, Any]:
    book.renamed.add(chat_id)
    book.put_first(chat_id, title)
    return {"id": chat_id, "rev": book.next_rev(chat_id), "title": title, "renamed": True}


def outbox(book: Book, *records: dict[str, Any]) -> dict[str, Any]:
    """What the page's script applies: the records, then which one this tab shows."""
    return {"records": list(records), "current": book.current}


def said_anything(data: dict[str, Any]) -> bool:
    return any(message.get("role") == "user" for message in data.get("messages", []))


def title_of(data: dict[str, Any]) -> str:
    first = next((m["content"] for m in data.get("messages", []) if m.get("role") == "user"), "New chat")
    first = " ".join(first.split())
    return first if len(first) <= MAX_TITLE_CHARS else first[: MAX_TITLE_CHARS - 1] + "…"


# The page's side (in <head>, before Gradio starts: the load event's `js` calls it). Which record
# a tab shows is the tab's own (sessionStorage: it survives a reload, a new tab starts a new chat).
SCRIPT = """<script>
window.rewindCopy = (() => {
  const PREFIX = "rewind-chat:chat:", REPLY = "rewind-chat:reply:", MAX_CHATS = %(max_chats)d, TOMBSTONE_DAYS = 30;
  const token = () => Array.from(crypto.getRandomValues(new Uint8Array(12)),
      (b) => "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"[b & 63]).join("");
  let tab = sessionStorage.getItem("rewind-chat:tab");
  if (!tab) { tab = token(); sessionStorage.setItem("rewind-chat:tab", tab); }
  const moved = {}, notices = [];
  let full = false, shownList = "";
  const current = () => sessionStorage.getItem("rewind-chat:current");
  const setCurrent = (id) => id ? sessionStorage.setItem("rewind-chat:current", id)
                                : sessionStorage.removeItem("rewind-chat:current");
  const parsed = (key) => { try { return JSON.parse(localStorage.getItem(key)); } catch { return null; } };
  const read = (id) => {  // a draft with the streaming reply so far (kept apart: small, written often)
    const rec = parsed(PREFIX + id), patch = rec && rec.draft && rec.data ? parsed(REPLY + id) : null;
    if (patch && patch.rev === rec.rev && patch.reply && typeof patch.reply === "object") {
      const path = rec.data.path, messages = rec.data.messages;
      const last = Array.isArray(path) && Array.isArray(messages) ? messages[path[path.length - 1]] : null;
      if (last && last.role === "assistant") Object.assign(last, patch.reply);
    }
    return rec;
  };
  const write = (rec) => {
    try { localStorage.setItem(PREFIX + rec.id, JSON.stringify(rec)); localStorage.removeItem(REPLY + rec.id); return true; }
    catch (error) { full = true; return false; }  // over the browser's quota: the server says so
  };
  const all = () => {
    const records = [];
    for (let i = 0; i < localStorage.length; i++) {
      const key = localStorage.key(i);
      const rec = key && key.startsWith(PREFIX) ? read(key.slice(PREFIX.length)) : null;
      if (rec && rec.id) records.push(rec);
    }
    return records;
  };
  const index = () => all().filter((r) => !r.deleted).sort((a, b) => (b.updated || 0) - (a.updated || 0))
      .map((r) => [r.id, r.title || ""]);
  const prune = () => {
    const now = Date.now(), live = [];
    for (const rec of all()) {
      if (rec.deleted && now - (rec.updated || 0) > TOMBSTONE_DAYS * 864e5) localStorage.removeItem(PREFIX + rec.id);
      else if (!rec.deleted) live.push(rec);
    }
    live.sort((a, b) => (b.updated || 0) - (a.updated || 0));
    for (const rec of live.slice(MAX_CHATS)) {
      if (rec.id === current()) continue;
      write({id: rec.id, rev: rec.rev + 1, deleted: true, tab, updated: now});
      notices.push(rec.title || "a conversation");
    }
  };
  const apply = (box) => {
    if (!box || !Array.isArray(box.records)) return;
    let copied = false;
    for (const incoming of box.records) {
      const stored = read(incoming.id), now = Date.now();
      const rec = {...incoming, tab, updated: now};
      if ("reply" in incoming) {  // the reply so far, beside this tab's own draft of that revision
        if (stored && stored.draft && stored.tab === tab && stored.rev === incoming.rev) {
          try { localStorage.setItem(REPLY + incoming.id, JSON.stringify({rev: incoming.rev, reply: incoming.reply})); }
          catch (error) { full = true; }
        }
        continue;
      }
      if (!("data" in incoming) && !incoming.deleted) {  // a rename: the stored data stays
        if (stored && !stored.deleted) write({...stored, title: rec.title, renamed: rec.renamed,
                                              rev: Math.max(stored.rev, rec.rev), tab, updated: now});
        continue;
      }
      const ownDraft = stored && stored.tab === tab && stored.draft && stored.rev === rec.rev;
      if (!stored || stored.rev < rec.rev || ownDraft) { write(rec); continue; }
      if (rec.draft) continue;  // a draft never displaces anything
      if (rec.deleted) { write({...rec, rev: stored.rev + 1}); continue; }  // the person deleted what they saw
      if (stored.deleted) continue;  // deleted since: a late write of what was there does not bring it back
      if (JSON.stringify(stored.data) === JSON.stringify(rec.data)) continue;  // the same
      // another tab wrote this conversation meanwhile: both are kept, this tab goes on with its copy
      const copy = {...rec, id: token(), rev: 1};
      if (write(copy)) { moved[incoming.id] = copy.id; copied = true; }
    }
    if ("current" in box) setCurrent(moved[box.current] ?? box.current);
    prune();
    shownList = JSON.stringify(index());  // the server lists what this tab wrote; a copy it must be told of
    if (copied) refreshList();
  };
  const refreshList = () => document.querySelector("#list-refresh")?.click();
  // Import by dropping a file anywhere on the page: its text goes as an Import's does
  const hasFiles = (event) => [...(event.dataTransfer?.types || [])].includes("Files");
  document.addEventListener("dragover", (event) => { if (hasFiles(event)) event.preventDefault(); }, true);
  document.addEventListener("drop", (event) => {
    const file = hasFiles(event) ? event.dataTransfer.files[0] : null;
    if (!file) return;
    event.preventDefault();
    event.stopPropagation();
    file.slice(0, %(max_json)d + 1).text().then((text) => {
      window.rewindDropped = text;
      document.querySelector("#import-drop")?.click();
    });
  }, true);
  window.addEventListener("storage", (event) => {  // another tab changed the list
    if (!event.key || !event.key.startsWith(PREFIX)) return;
    const listed = JSON.stringify(index());
    if (listed !== shownList) { shownList = listed; refreshList(); }
  });
  const live = (id) => { const rec = id ? read(id) : null; return rec && !rec.deleted ? rec : null; };
  const probe = () => {
    const id = current(), rec = live(id);
    const said = {current: id, rev: rec ? rec.rev : null, moved: {...moved}, full, notices: notices.splice(0)};
    full = false;
    return said;
  };
  return {
    apply, probe, record: live,
    all: () => all().filter((rec) => !rec.deleted && rec.data).sort((a, b) => (b.updated || 0) - (a.updated || 0)),
    withList: () => { prune(); const listed = index(); shownList = JSON.stringify(listed);
                      return {...probe(), index: listed}; },
    onLoad: () => { prune(); const listed = index(); shownList = JSON.stringify(listed);
                    let pending = null;
                    try { pending = JSON.parse(sessionStorage.getItem("rewind-chat:pending-prompt")); } catch {}
                    // opened from a shared link's "Continue in a new chat": copied once (a reload does not copy again)
                    const share = new URLSearchParams(location.search).get("share");
                    if (share) history.replaceState(null, "", location.pathname + location.hash);
                    const revs = Object.fromEntries(all().map((rec) => [rec.id, rec.rev]));  // what a signed-in load lacks
                    return {...probe(), index: listed, record: live(current()), pending, share, revs}; },
    pickFile: () => new Promise((resolve) => {  // Import: the chosen file's text (one byte over the
      // limit at most: the server says it is too large), or null when none was chosen
      const input = Object.assign(document.createElement("input"), {type: "file", accept: ".json,application/json"});
      input.addEventListener("change", () => {
        const file = input.files && input.files[0];
        if (!file) { resolve(null); return; }
        file.slice(0, %(max_json)d + 1).text().then(resolve, () => resolve(null));
      });
      input.addEventListener("cancel", () => resolve(null));
      input.click();
    }),
    typedPrompt: (text) => {  // the system prompt box as typed: a reload shows it again, still pending
      try { sessionStorage.setItem("rewind-chat:pending-prompt", JSON.stringify({id: current(), text})); } catch {}
    },
  };
})();
</script>""" % {"max_chats": MAX_CHATS, "max_json": saved.MAX_JSON_BYTES}
