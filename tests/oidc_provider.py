"""A small OpenID Connect provider for the sign-in tests: it stands in for huggingface.co.

Gradio's OAuth (on a Space) reads the provider from `OPENID_PROVIDER_URL` and follows the
standard code flow through authlib: discovery, `/authorize` (here: approved at once, as whoever
the test says is signing in), `/token` (checked: the code, the client's id and secret, the
redirect address) with an RS256 `id_token` whose signature, issuer, audience, nonce and expiry
authlib verifies against `/jwks`, and `/userinfo`.
"""

from __future__ import annotations

import base64
import json
import secrets
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from joserfc import jwt
from joserfc.jwk import RSAKey


class Provider:
    def __init__(self, client_id: str = "rewind-test-client", client_secret: str = "rewind-test-secret") -> None:
        self.client_id, self.client_secret = client_id, client_secret
        self.key = RSAKey.generate_key(2048)
        self.users: dict[str, dict] = {}
        self.signing_in = ""  # the user `/authorize` approves
        self.codes: dict[str, tuple[str, str, str]] = {}  # code -> (user, nonce, redirect_uri)
        self.tokens: dict[str, str] = {}  # access token -> user
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_user(self, sub: str, username: str) -> None:
        self.users[sub] = {"sub": sub, "name": username.title(), "preferred_username": username,
                           "profile": f"https://huggingface.co/{username}", "picture": "", "website": ""}

    def close(self) -> None:
        self.server.shutdown()

    def environment(self) -> dict[str, str]:
        """What a Space with `hf_oauth: true` gets (and the test's app, to stand in for it)."""
        return {"SYSTEM": "spaces", "SPACE_ID": "test/rewind-chat", "OPENID_PROVIDER_URL": self.url,
                "OAUTH_CLIENT_ID": self.client_id, "OAUTH_CLIENT_SECRET": self.client_secret,
                "OAUTH_SCOPES": "openid profile"}

    def _id_token(self, user: str, nonce: str) -> str:
        now = int(time.time())
        claims = {**self.users[user], "iss": self.url, "aud": self.client_id, "iat": now, "exp": now + 3600,
                  "auth_time": now, "nonce": nonce}
        return jwt.encode({"alg": "RS256", "kid": "test"}, claims, self.key)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _json(self, value: object, status: int = 200) -> None:
                body = json.dumps(value).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802
                url = urllib.parse.urlparse(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                if url.path == "/.well-known/openid-configuration":
                    self._json({"issuer": provider.url, "authorization_endpoint": provider.url + "/authorize",
                                "token_endpoint": provider.url + "/token", "userinfo_endpoint": provider.url + "/userinfo",
                                "jwks_uri": provider.url + "/jwks", "response_types_supported": ["code"],
                                "subject_types_supported": ["public"], "id_token_signing_alg_values_supported": ["RS256"],
                                "token_endpoint_auth_methods_supported": ["client_secret_basic", "client_secret_post"]})
                elif url.path == "/jwks":
                    self._json({"keys": [{**provider.key.as_dict(private=False), "kid": "test", "alg": "RS256",
                                          "use": "sig"}]})
                elif url.path == "/authorize":
                    if query.get("client_id") != provider.client_id or provider.signing_in not in provider.users:
                        self._json({"error": "access_denied"}, 400)
                        return
                    code = secrets.token_urlsafe(16)
                    provider.codes[code] = (provider.signing_in, query.get("nonce", ""), query["redirect_uri"])
                    target = query["redirect_uri"] + ("&" if "?" in query["redirect_uri"] else "?") + \
                        urllib.parse.urlencode({"code": code, "state": query.get("state", "")})
                    self.send_response(302)
                    self.send_header("location", target)
                    self.end_headers()
                elif url.path == "/userinfo":
                    token = self.headers.get("authorization", "").removeprefix("Bearer ")
                    user = provider.tokens.get(token)
                    self._json(provider.users[user] if user else {"error": "invalid_token"}, 200 if user else 401)
                else:
                    self._json({"error": "not found"}, 404)

            def do_POST(self) -> None:  # noqa: N802
                if urllib.parse.urlparse(self.path).path != "/token":
                    self._json({"error": "not found"}, 404)
                    return
                form = dict(urllib.parse.parse_qsl(self.rfile.read(int(self.headers.get("content-length", 0))).decode()))
                basic = self.headers.get("authorization", "")
                if basic.startswith("Basic "):
                    client_id, _, secret = base64.b64decode(basic[6:]).decode().partition(":")
                    client_id, secret = urllib.parse.unquote(client_id), urllib.parse.unquote(secret)
                else:
                    client_id, secret = form.get("client_id", ""), form.get("client_secret", "")
                found = provider.codes.pop(form.get("code", ""), None)
                if (client_id, secret) != (provider.client_id, provider.client_secret) or found is None \
                        or found[2] != form.get("redirect_uri"):
                    self._json({"error": "invalid_grant"}, 400)
                    return
                user, nonce, _ = found
                access = secrets.token_urlsafe(24)
                provider.tokens[access] = user
                self._json({"access_token": access, "token_type": "Bearer", "expires_in": 3600,
                            "scope": "openid profile", "id_token": provider._id_token(user, nonce)})

        return Handler
