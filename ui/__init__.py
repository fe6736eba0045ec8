"""The Gradio app's parts; app.py lays them out and wires them. Knows no cache internals.

Module map:
  config.py     AppConfig: every flag, its default and its environment variable, read in one place
  directory.py  which conversation each browser has (server-made keys), per-client limits, tab close
  shared.py     what every handler shares: the engine, the directory, limits, drawing a conversation
  actions.py    what a control asks of the conversation, as plain data (Undo, SwitchBranch... and
                chat.dialogue.operations' Send, Regenerate, Edit, Continue)
  handlers.py   ChatHandlers: each event's inputs made into an action, and `act`, the one way from
                an action to the conversation; the Chatbot's own events, translated to actions
  replies.py    the actions that make a reply: plan, then stream it as ChatOutputs
  wiring.py     which component triggers which handler, with which inputs and outputs
  page_assets.py  the page's script, style and LaTeX delimiters
  chat_list.py  the conversations each browser keeps: list, open, new, rename, delete, export, import
  browser_copy.py  how the browser keeps them: one record per conversation, merged by revision (its script)
  accounts.py   signed in (Hugging Face OAuth): the records kept in the store too, settings, taking a
                conversation over on another device, sign-outs that a replayed cookie cannot undo
  sharing.py    share by link: the snapshot, the read-only page at /share/<id>, revoking
  outputs.py    ChatOutputs (what every handler returns, by name) and Settings (inputs, by name)
  inputs.py     checking what a client sends, by field name, before anything runs; the size limits
  operator.py   /healthz, /status and /metrics (Prometheus) for operators: aggregate numbers only
  security.py   the Content-Security-Policy and other headers on every response
  views.py      pure functions: history to Chatbot messages (with ‹ 2 / 3 › and ↻), the stats line
  gradio_tuning.py  two costs of Gradio's that slowed decoding while a reply streams, removed
"""
