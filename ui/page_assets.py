"""What the page carries besides its components: its script (the phone layout, Escape, the branch
controls inside the chat), its style, and the LaTeX delimiters the chat renders."""

from chat.typing_ahead import PREPARE_EVERY_S

# How often the page asks the server to prepare the message being typed, the terminal
# chat's pace too (chat/typing_ahead.py).
PREPARE_EVERY_MS = round(PREPARE_EVERY_S * 1000)

PAGE_SCRIPT = """() => {
    const narrow = window.matchMedia("(max-width: 700px)").matches;
    for (let wait = 0; narrow && wait < 5000; wait += 100) {  // a phone: the list starts folded away
        setTimeout(() => {
            const sidebar = document.querySelector("#sidebar");
            if (sidebar && !sidebar.dataset.folded && sidebar.closest(".sidebar.open, .open")) {
                sidebar.dataset.folded = "1";
                sidebar.closest(".sidebar, .open")?.querySelector("button[aria-label='Toggle Sidebar']")?.click();
            }
        }, wait);
    }
    const foldList = (event, picked) => {  // a phone: the list folds away once a chat is picked
        if (!window.matchMedia("(max-width: 700px)").matches || !event.target.closest?.(picked)) return;
        const toggle = document.querySelector(".sidebar.open button[aria-label='Toggle Sidebar']");
        if (toggle) setTimeout(() => toggle.click(), 0);
    };
    document.addEventListener("click", (event) => foldList(event, "#new-chat"));
    document.addEventListener("change", (event) => foldList(event, "#chat-list"));  // (a label's click is two)
    // Gradio names each message by its raw text: for the branch controls, their markup. They are
    // named by what they are instead ("Branches: Previous branch 2 / 3 Next branch").
    // Other messages are named by their text without markup ("…: stopped", not "<sub>stopped</sub>").
    // The Thinking fold's button Gradio leaves unnamed is named for what it does.
    const nameControls = () => {
        document.querySelectorAll('#chatbot [aria-label*="<"]').forEach((message) => {
            const nav = message.querySelector(".branch-nav"), label = message.getAttribute("aria-label");
            const named = nav ? `Branches: ${nav.textContent.trim()}`
                              : label.replace(/<[^>]*>/g, " ").replace(/\s+/g, " ").trim();
            if (named !== label) message.setAttribute("aria-label", named);  // (a set is a mutation: only a change)
        });
        document.querySelectorAll('#chatbot .thought-group .title button[aria-label=""]').forEach((fold) => {
            fold.setAttribute("aria-label", "Show or hide the thinking");
            fold.title = "Show or hide the thinking";
        });
    };
    new MutationObserver(nameControls).observe(document.body, {subtree: true, childList: true, attributes: true,
                                                               attributeFilter: ["aria-label"]});
    document.addEventListener("keydown", (event) => {  // Escape stops a reply
        if (event.key === "Escape") document.querySelector("#stop")?.click();
    });
    // Typing ahead: Enter while a reply streams does not send (that would be refused, or
    // worse); the message waits in the box, a line under it says so, and it is sent as the reply
    // ends (Stop ends it now). Emptying the box takes the message back.
    const shown = (selector) => { const node = document.querySelector(selector); return !!node && node.offsetParent !== null; };
    const box = () => document.querySelector("#message textarea");
    let waiting = false, waitNote = null;
    const showWaiting = (on) => {
        waiting = on;
        if (!waitNote) {
            waitNote = Object.assign(document.createElement("div"), {id: "waiting-note", className: "waiting-note"});
            waitNote.setAttribute("role", "status");
            document.querySelector("#input-row")?.after(waitNote);
        }
        waitNote.textContent = on ? "Sent when this reply ends (Stop ends it now; empty the box to cancel)." : "";
    };
    // What is sent is what the box held at Enter or Send: the server reads the box when its
    // step runs, after the chain's first steps, and a second message typed meanwhile was sent in
    // its place (or cleared by the first reply). Until the reply starts (Stop shows) a send is in
    // flight: another Enter waits like one typed during the reply; and the box is emptied then
    // only if it still holds what was sent.
    let sentText = null, sentAt = 0, sentRows = 0, enterHeld = false;
    const userRows = () => document.querySelectorAll("#chatbot .message-row.user-row").length;
    // A New chat on its way counts as a send in flight: a message sent before its answer came went
    // to the conversation left, and the answer then drew an empty chat over it. It waits, and goes
    // to the new chat once the New chat's event ends (it says so: `rewindSwitched`).
    let switchingAt = 0;
    window.rewindSwitched = () => { switchingAt = 0; };
    document.addEventListener("click", (event) => {
        if (event.target.closest?.("#new-chat")) switchingAt = Date.now();
    }, true);
    const inFlight = () => (sentText !== null && Date.now() - sentAt < 2000)
        || (switchingAt > 0 && Date.now() - switchingAt < 10000);
    const markSent = () => {
        sentText = box().value; sentAt = Date.now(); sentRows = userRows(); window.rewindSent = sentText;
    };
    const holdEnter = (event) => {  // (and an empty box sends nothing, as Send is disabled then)
        if (event.key !== "Enter" || event.shiftKey || event.isComposing || event.target !== box()) return;
        if (box().value.length > limit()) {  // over the limit: the line under the box says so; nothing is sent
            event.preventDefault();
            event.stopImmediatePropagation();
            return;
        }
        const empty = !box().value.trim();
        if (event.type === "keydown") {  // decided once a keystroke: its keypress follows the keydown
            enterHeld = empty || shown("#stop") || inFlight();
            if (!enterHeld) markSent();
        }
        if (!enterHeld) return;
        event.preventDefault();
        event.stopImmediatePropagation();
        if (event.type === "keydown" && !empty) showWaiting(true);
    };
    // Send is disabled while the box is empty: other chat apps do so, and a toast said "Error".
    // And while the message is over the server's limit, which a line under the box says as it is
    // crossed (a 200,000-character paste was refused only after Send).
    const limit = () => Number((document.querySelector("#message")?.className.match(/limit-(\d+)/) || [])[1] || Infinity);
    let overNote = null;
    const sendState = () => {
        const send = document.querySelector("#send");
        if (!send || !box()) return;
        const length = box().value.length, over = length > limit();
        if (!overNote && over) {
            overNote = Object.assign(document.createElement("div"), {id: "over-limit-note", className: "waiting-note"});
            overNote.setAttribute("role", "status");
            document.querySelector("#input-row")?.after(overNote);
        }
        if (overNote) overNote.textContent = over ? `This message is ${length.toLocaleString()} characters, over the `
            + `limit of ${limit().toLocaleString()}: shorten it to send it.` : "";
        send.disabled = !box().value.trim() || over;
    };
    document.addEventListener("input", (event) => {
        sendState();
        if (waiting && event.target === box() && !box().value.trim()) showWaiting(false);  // taken back
        if (event.target.closest?.("#system-prompt")) window.rewindCopy.typedPrompt(event.target.value);
    }, true);
    document.addEventListener("click", (event) => {
        if (!event.target.closest?.("#send") || !box()) return;
        if (!box().value.trim() || inFlight()) {  // nothing to send; or one is on its way: this one waits
            event.preventDefault();
            event.stopImmediatePropagation();
            if (box().value.trim()) showWaiting(true);
            return;
        }
        markSent();
    }, true);
    document.addEventListener("keydown", holdEnter, true);
    document.addEventListener("keypress", holdEnter, true);
    // Prepare the reply while typing: the server prefills the chat as it will be with the
    // message as it stands, when no reply has work. At most every PREPARE_EVERY_MS ms: at typing
    // speed that is each keystroke, at once, so a Send at the next keystroke finds the text it
    // sends prefilled; faster, the text as it stands once that time is up, and always the last.
    // (It waited for a 400 ms pause, then went once a second only after a first prepare: typed
    // without a pause, a message was never prepared before its Send.) A newer prepare calls the
    // older one off on the server. The switch in Settings is kept in this browser; off, nothing
    // is sent before Send. `rewindPrepare` says what was asked and what the server has taken.
    const PREPARE = "rewind-chat:prepare-while-typing";
    const prepareOn = () => localStorage.getItem(PREPARE) !== "off";
    const canPrepare = () => prepareOn() && !!box() && !!box().value.trim() && !shown("#stop");
    window.rewindPrepare = {asked: 0, taken: 0, pending: false};
    let prepareTimer = null, preparedAt = 0;
    const prepareNow = () => {
        prepareTimer = null;
        window.rewindPrepare.pending = false;
        if (!canPrepare()) return;
        preparedAt = Date.now();
        window.rewindPrepare.asked += 1;
        document.querySelector("#prepare-go")?.click();
    };
    const prepareSoon = () => {
        if (prepareTimer !== null || !canPrepare()) return;  // one already set takes the text as it then stands
        window.rewindPrepare.pending = true;  // (a moment at least: the box's value reaches the page's state)
        prepareTimer = setTimeout(prepareNow, Math.max(20, preparedAt + PREPARE_EVERY_MS - Date.now()));
    };
    document.addEventListener("input", (event) => { if (event.target === box()) prepareSoon(); }, true);
    document.addEventListener("change", (event) => {
        if (!event.target.closest?.("#prepare-toggle")) return;
        localStorage.setItem(PREPARE, event.target.checked ? "on" : "off");
    }, true);
    setInterval(() => {  // the switch shows what this browser keeps (no click: nothing else is touched)
        const toggle = document.querySelector("#prepare-toggle input");
        if (toggle && toggle.checked !== prepareOn()) toggle.checked = prepareOn();
    }, 250);
    setInterval(() => {  // the reply ended: Send is back (and the box may have been set by the server)
        sendState();
        const rows = document.querySelectorAll("#chatbot .message-row");  // none: nothing to export or delete
        const empty = !rows.length, last = rows[rows.length - 1];
        // Continue: only a last reply the model did not end (its note carries the class, ui/views.py)
        const continuable = !!last && last.classList.contains("bot-row") && !!last.querySelector("sub.continuable");
        for (const id of ["#continue", "#export-json", "#export-markdown", "#delete"]) {
            const button = document.querySelector(id), off = id === "#continue" ? !continuable : empty;
            if (button && button.disabled !== off) button.disabled = off;
        }
        const began = sentText !== null && userRows() > sentRows;  // its message is in the chat
        if (sentText !== null && (began || !inFlight())) {  // the reply began (or the send was refused)
            if (began && box() && box().value === sentText) {
                box().value = "";
                box().dispatchEvent(new Event("input", {bubbles: true}));
            }
            sentText = null;
        }
        if (waiting && shown("#send") && !shown("#stop") && !inFlight()) {
            showWaiting(false);
            if (box()?.value.trim()) document.querySelector("#send")?.click();
        }
    }, 100);
    // The list: each entry's day group, time and a line of its last message, and a search
    // over titles and messages, read from this browser's records (the server knows titles only).
    // Drawn as data attributes the style shows, so Gradio's own list stays as it renders it.
    const searchable = new Map();  // id -> [rev, lower-case text of its title and messages]
    const textOf = (id, rec) => {
        const known = searchable.get(id);
        if (known && known[0] === rec.rev) return known[1];
        const messages = Array.isArray(rec.data?.messages) ? rec.data.messages : [];
        const text = [rec.title || "", ...messages.map((m) => typeof m?.content === "string" ? m.content : "")]
            .join("\\n").toLowerCase();
        searchable.set(id, [rec.rev, text]);
        return text;
    };
    const dayGroup = (ms) => {
        const day = new Date(ms).setHours(0, 0, 0, 0), today = new Date().setHours(0, 0, 0, 0);
        return day >= today ? "Today" : day >= today - 864e5 ? "Yesterday"
             : day >= today - 7 * 864e5 ? "Previous 7 days" : "Earlier";
    };
    const previewOf = (rec) => {
        const path = rec.data?.path, messages = rec.data?.messages;
        const last = Array.isArray(path) && Array.isArray(messages) ? messages[path[path.length - 1]] : null;
        const text = typeof last?.content === "string" ? last.content.replace(/\s+/g, " ").trim() : "";
        return text.length > 80 ? text.slice(0, 79) + "…" : text;
    };
    const set = (node, name, value) => { if (node.getAttribute(name) !== value) node.setAttribute(name, value); };
    const drawList = () => {
        const query = (document.querySelector("#chat-search input, #chat-search textarea")?.value || "")
            .trim().toLowerCase();
        let group = null;
        for (const label of document.querySelectorAll("#chat-list label")) {
            const id = label.querySelector("input")?.value, rec = id ? window.rewindCopy?.record(id) : null;
            const hit = !query || (rec ? textOf(id, rec) : label.textContent.toLowerCase()).includes(query);
            if (label.hidden !== !hit) label.hidden = !hit;
            const when = rec?.updated ? new Date(rec.updated) : null, heading = when ? dayGroup(rec.updated) : "";
            set(label, "data-when", when ? (heading === "Today" || heading === "Yesterday"
                ? when.toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"})
                : when.toLocaleDateString([], {month: "short", day: "numeric"})) : "");
            set(label, "data-preview", rec ? previewOf(rec) : "");
            set(label, "data-for", id || "");  // what it was drawn for (Gradio reuses a label for another entry)
            set(label, "data-group", hit && heading !== group ? heading : "");
            if (hit) group = heading;
        }
    };
    document.addEventListener("input", (event) => { if (event.target.closest?.("#chat-search")) drawList(); }, true);
    const redraw = new MutationObserver(drawList);  // Gradio redrew the list: at once (attributes aside)
    const watch = setInterval(() => {
        const list = document.querySelector("#chat-list");
        if (list) { redraw.observe(list, {childList: true, subtree: true, characterData: true}); clearInterval(watch); }
    }, 200);
    setInterval(drawList, 1000);  // a record written (its time, its last message): drawn again (cached text)
    // the links this browser shared (ui/sharing.py): drawn once their box is on the page, again if Gradio redraws it
    setInterval(() => { const box = document.querySelector("#shared-links");
                        if (box && !box.querySelector(".shared-list")) window.rewindShares?.draw(); }, 300);

    // The chat takes the window's height with the box at its foot: its height is what the
    // window leaves once what is above it (the title) and below it (the box, the line under it) is drawn
    const fit = () => {
        const chat = document.querySelector("#chatbot"), last = document.querySelector("#stats");
        if (!chat || !last) return;
        const top = chat.getBoundingClientRect().top + window.scrollY;
        const below = last.getBoundingClientRect().bottom - chat.getBoundingClientRect().bottom;
        const height = Math.max(240, Math.floor(window.innerHeight - top - below - 12));
        if (chat.style.getPropertyValue("height") !== `${height}px`) chat.style.setProperty("height", `${height}px`, "important");
    };
    window.addEventListener("resize", fit);
    const sized = new ResizeObserver(fit);
    const watchSizes = setInterval(() => {
        const parts = ["#header", "#input-row", "#stats"].map((selector) => document.querySelector(selector));
        if (parts.every(Boolean)) { parts.forEach((part) => sized.observe(part)); fit(); clearInterval(watchSizes); }
    }, 100);

    // "Branch off into a new chat": a button beside each message's own (copy, edit); the
    // message's place in the chat goes to the server (FORK_INPUT), which knows what it is
    const addForks = () => document.querySelectorAll("#chatbot .message-buttons .icon-button-wrapper").forEach((bar) => {
        const row = bar.closest(".message-buttons")?.previousElementSibling;
        if (bar.querySelector(".fork-here") || !row?.classList.contains("message-row")
            || row.querySelector(".branch-nav")) return;
        const button = Object.assign(document.createElement("button"),
                                     {type: "button", className: "icon-button fork-here", title: "Branch off into a new chat"});
        button.setAttribute("aria-label", "Branch off into a new chat");
        button.innerHTML = '<svg viewBox="0 0 16 16" width="14" height="14" aria-hidden="true" fill="none" ' +
            'stroke="currentColor" stroke-width="1.5"><circle cx="4" cy="3" r="1.6"/><circle cx="4" cy="13" r="1.6"/>' +
            '<circle cx="12" cy="5" r="1.6"/><path d="M4 4.6v6.8M12 6.6c0 3-8 2.4-8 5"/></svg>';
        bar.appendChild(button);
    });
    new MutationObserver(addForks).observe(document.body, {subtree: true, childList: true});
    document.addEventListener("click", (event) => {
        const button = event.target.closest?.("button.fork-here");
        if (!button) return;
        const row = button.closest(".message-buttons")?.previousElementSibling;
        const place = [...document.querySelectorAll("#chatbot .message-wrap > .message-row")].indexOf(row);
        if (place < 0) return;
        window.rewindForkTarget = String(place);
        document.querySelector("#fork-go")?.click();
    }, true);

    document.addEventListener("click", (event) => {  // "‹ 2 / 3 ›" and ↻ under a message
        const button = event.target.closest?.("button.branch-step");
        if (!button || button.disabled) return;
        event.preventDefault();
        event.stopPropagation();
        const step = [...button.classList].map((c) => c.match(/^bs-(\\d+)-(\\d+)$/)).find(Boolean);
        const retry = [...button.classList].map((c) => c.match(/^br-(\\d+)$/)).find(Boolean);
        if (!(step || retry)) return;
        // the event's own `js` (TARGET_INPUT) hands this to the server: no textbox to race with
        window.rewindBranchTarget = step ? `${step[1]}:${step[2]}` : retry[1];
        document.querySelector(step ? "#branch-go" : "#retry-go")?.click();
    }, true);
}""".replace("PREPARE_EVERY_MS", str(PREPARE_EVERY_MS))
# Run in the page as the ‹ › / ↻ event starts: the target the click above stored becomes the
# event's first input (API clients send their own; this runs only in a page).
TARGET_INPUT = "(target, ...settings) => [window.rewindBranchTarget ?? target, ...settings]"
FORK_INPUT = "(target, ...rest) => [window.rewindForkTarget ?? target, ...rest]"
CSS = """
/* one New chat (the list's): the chat's own trash button is not shown */
#chatbot button[aria-label="Clear"] { display: none !important; }
#header { min-height: 0; }
#header p { margin: 0; font-size: 0.95rem; }
#stats { font-size: 0.8rem; opacity: 0.75; min-height: 0; }
#stats p { margin: 0; }
#input-row { align-items: stretch; }
#continue { min-width: 88px; }
#chatbot button.fork-here { font-size: 15px; line-height: 1; min-width: 24px; color: var(--block-label-text-color);
                            background: transparent; border: none; cursor: pointer; }
#shared-links .shared-link { display: flex; align-items: center; gap: 8px; justify-content: space-between;
                             padding: 4px 0; }
#shared-links .shared-link a { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
#shared-links button.revoke { min-height: 32px; padding: 0 10px; border-radius: 6px;
                              border: 1px solid var(--border-color-primary); background: var(--button-secondary-background-fill); }
/* a refusal is one toast: Gradio's "Error" badge over each of the event's outputs stays hidden */
[data-testid="status-tracker"]:has(.error) { display: none !important; }
.branch-nav { font-size: 0.85em; opacity: 0.85; white-space: nowrap; }
.message-row:has(.branch-nav) .message { background: none !important; border: none !important;
  padding: 0 !important; box-shadow: none !important; }
.branch-nav button { padding: 0 0.5em; font-size: 1.1em; cursor: pointer; }
.branch-step.prev::before { content: "‹" / ""; }  /* drawn, not read: the button's name is its text */
.branch-step.next::before { content: "›" / ""; }
.branch-step.regen::before { content: "↻" / ""; }
/* the list: a day's heading above its first entry, each entry's time and last message */
/* (the heading is drawn, not read as part of the entry's name: a screen reader hears the entry's own name) */
#chat-list label[data-group]:not([data-group=""])::before { content: attr(data-group) / ""; display: block; width: 100%;
  font-size: 0.75em; font-weight: 600; opacity: 0.7; margin: 0.4em 0 0.1em; }
#chat-list label { flex-wrap: wrap; }
#chat-list label[data-when]:not([data-when=""])::after { content: attr(data-when) " · " attr(data-preview);
  display: block; width: 100%; font-size: 0.75em; opacity: 0.65; overflow: hidden; text-overflow: ellipsis;
  white-space: nowrap; }
#chat-list label[hidden] { display: none !important; }
/* Gradio's footer ends in a separator before its hidden "Stop Recording": a stray "·" */
footer .divider:last-child { display: none !important; }
/* the chat's trash button: messages scroll under an opaque chip, not through the icon */
#chatbot .icon-button-wrapper.top-panel { background: var(--block-background-fill); border-radius: var(--radius-sm); }
.waiting-note { font-size: 0.85em; opacity: 0.8; padding: 0 0.5em; min-height: 0; }
.waiting-note:empty { display: none; }
.sr-only { position: absolute; width: 1px; height: 1px; overflow: hidden; clip-path: inset(50%); white-space: nowrap; }
@media (max-width: 640px), (pointer: coarse) {  /* a finger's size */
  .branch-nav button { min-width: 40px; min-height: 40px; }
  #chatbot .message-buttons button, #chatbot .message-buttons-left button, #chatbot .message-buttons-right button {
    min-width: 40px; min-height: 40px; }
  #continue, #new-chat, #dark-mode { min-height: 40px; }
  /* the chat's trash button and a reply's Thinking expander were 18 px, the list's buttons 26 */
  #chatbot .icon-button-wrapper.top-panel button { min-width: 40px; min-height: 40px; }
  #chatbot .thought-group .title { min-height: 40px; }
  #chatbot .thought-group .title .arrow button { min-width: 40px; min-height: 40px; }
  #sidebar button { min-height: 40px; }
}
/* Gradio's "•••" waiting bubble belongs after the user's message, until the reply's first text.
   Its node is reused as the list grows and can land between earlier messages (seen under an
   earlier reply while another streamed): there, or after a reply, it is hidden. */
#chatbot .message-wrap > .container:has(> [aria-label="Loading response"]):not(:last-child),
#chatbot .message-wrap > .message-buttons-left + .container:has(> [aria-label="Loading response"]),
#chatbot .message-wrap > .bot-row + .container:has(> [aria-label="Loading response"]) { display: none !important; }
/* a reply's thinking is not edited (its answer is): no Edit pencil under it */
.message-row:has(.thought-group) + .message-buttons button[aria-label="Edit"] { display: none !important; }
.branch-nav button:disabled { opacity: 0.3; cursor: default; }
/* the controls under a message are a message of their own: no copy or edit buttons on them */
.message-row:has(.branch-nav) + .message-buttons { display: none !important; }
@media (max-width: 640px) {  /* a phone: the chat fills the screen, the input and its button stay in view */
  /* the list's toggle: a whole 40 px circle in view, open or closed, beside the title (not over it) */
  .sidebar .toggle-button { width: 40px !important; height: 40px !important; border-radius: 50% !important; }
  .sidebar:not(.open) .toggle-button { left: auto !important; right: -44px !important; }
  .sidebar.open .toggle-button { left: auto !important; right: 16px !important; top: auto !important;
                                 bottom: 16px !important; }  /* under the thumb, clear of the list */
  #header { padding-left: 48px; }  /* beside the list's toggle, not under it */
  #continue:disabled { display: none; }  /* the box keeps the width: Continue shows when a reply can go on */
  #input-row { position: sticky; bottom: 0; z-index: 10; flex-wrap: nowrap !important;
               background: var(--body-background-fill); padding-bottom: 4px; }
  #input-row > * { min-width: 0 !important; }
  #send, #stop { flex: 0 0 72px !important; }
}
"""
LATEX = [{"left": "$$", "right": "$$", "display": True}, {"left": "\\[", "right": "\\]", "display": True},
         {"left": "$", "right": "$", "display": False}, {"left": "\\(", "right": "\\)", "display": False}]

# The settings panel and the light/dark choice, kept in this browser (localStorage) so a reload
# keeps them: plain values, never a conversation. Each stored value is used only if it has the
# type of its default and lies in its control's range; the server checks every event anyway.
SETTINGS_KEY = "rewind-chat:settings"
THEME_KEY = "rewind-chat:theme"
SETTINGS_SCRIPT = """<script>
window.rewindSettings = {
  save(names, values) {
    try { localStorage.setItem(%(settings)s, JSON.stringify(Object.fromEntries(names.map((n, i) => [n, values[i]])))); }
    catch (error) {}
  },
  restore(spec, values) {
    let kept = {};
    try { kept = JSON.parse(localStorage.getItem(%(settings)s) || "{}") || {}; } catch (error) {}
    return spec.map(([name, kind, low, high], i) => {
      const value = kept[name];
      if (kind === "number" && typeof value === "number" && value >= low && value <= high) return value;
      if (kind === "boolean" && typeof value === "boolean") return value;
      if (kind === "string" && typeof value === "string" && value.length <= high) return value;
      return values[i];
    });
  },
  toggleTheme() {
    const dark = document.body.classList.toggle("dark");
    try { localStorage.setItem(%(theme)s, dark ? "dark" : "light"); } catch (error) {}
  },
  restoreTheme() {
    let theme = null;
    try { theme = localStorage.getItem(%(theme)s); } catch (error) {}
    if (theme === "dark" || theme === "light") document.body.classList.toggle("dark", theme === "dark");
  },
};
</script>""" % {"settings": repr(SETTINGS_KEY).replace("'", '"'), "theme": repr(THEME_KEY).replace("'", '"')}
