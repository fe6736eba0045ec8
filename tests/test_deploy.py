"""deploy/ is on paper (no GPU, no Docker here): what can be checked without running it is."""

import json
import re
import shlex
from pathlib import Path

import jsonschema
import yaml

from ui.config import AppConfig

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "deploy" / "docker-compose.yml"


def test_the_compose_file_follows_the_compose_specification():
    schema = json.loads((ROOT / "tests" / "fixtures" / "compose-spec.json").read_text())
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load(COMPOSE.read_text()))


def test_the_app_replicas_are_started_with_flags_the_app_has():
    command = yaml.safe_load(COMPOSE.read_text())["services"]["app"]["command"]
    app_line = command.split("python app.py", 1)[1].rstrip('"\n ')
    app_line = re.sub(r"\$\{(\w+):-([^}]*)\}", r"\2", app_line)  # compose's ${VAR:-default}: the default
    config = AppConfig.from_args(shlex.split(app_line), environ={})
    assert (config.backend, config.base_url, config.prompt_format) == ("openai", "http://router:8001/v1", "token-ids")
    assert config.host == "0.0.0.0" and config.model == "Qwen/Qwen3-8B"
    assert config.proxies == "172.16.0.0/12,192.168.0.0/16"  # the load balancer's network, and no one else
