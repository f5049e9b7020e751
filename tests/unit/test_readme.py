"""The README is the front page: short, no history, and its quickstart is what `./scripts/demo.sh` runs.

The demo story (scripts/demo_cluster.py) reads the README's quickstart block and runs each command as
written; here, without a cluster, that the block parses into exactly the commands the story knows how to
run, and that the default demo changes none of them. The node tier (tests/operator/node/
test_demo_story.py) runs them against the cluster.
"""
from __future__ import annotations

import re
from types import ModuleType

import pytest

from tests.support import REPO_ROOT
from tests.support.scripts import load_script

README = (REPO_ROOT / "README.md").read_text()


def load_demo() -> ModuleType:
    return load_script("demo_cluster")


def test_readme_is_a_front_page_without_history():
    assert len(README.splitlines()) <= 130
    # a commit hash: 7 to 40 hex digits with at least one digit and one letter, as a word of its own
    hashes = [w for w in re.findall(r"\b[0-9a-f]{7,40}\b", README) if re.search(r"\d", w) and re.search(r"[a-f]", w)]
    assert not hashes, hashes
    first_screen = "\n".join(README.splitlines()[:12])
    assert "Kubernetes operator" in first_screen and "RL post-training" in first_screen
    assert "<!-- times: measured by the lead -->" in README


_MONTH = (r"(Jan(uary)?|Feb(ruary)?|Mar(ch)?|Apr(il)?|May|June?|July?|Aug(ust)?|Sept?(ember)?|Oct(ober)?"
          r"|Nov(ember)?|Dec(ember)?)")
# The shapes a date takes in prose: numeric (2026-12-06, 12/06/2026, 6.12.2026), a month with a day or a
# year (Dec 6, December 2026, 6 Dec, 6th of December), a month alone (but May, also a verb), a year of
# this project's era alone, a weekday, or a day told relative to when it was written.
_DATES = [
    r"\b\d{4}[-/.]\d{1,2}[-/.]\d{1,2}\b",
    r"\b\d{1,2}/\d{1,2}/\d{2,4}\b",
    r"\b\d{1,2}\.\d{1,2}\.\d{4}\b",
    rf"\b{_MONTH}\.?,?\s+\d{{1,4}}(st|nd|rd|th)?\b",
    rf"\b\d{{1,2}}(st|nd|rd|th)?\s+(of\s+)?{_MONTH}\b",
    r"\b(January|February|March|April|June|July|August|September|October|November|December)\b",
    r"\b20[23]\d\b",
    r"\b(Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)\b",
    r"(?i)\b(today|yesterday|tomorrow|(this|last|that) (morning|afternoon|evening|night|week|month|year)"
    r"|earlier that day)\b",
]
# A duration as the README writes one: "25 min", "1 min 46 s", "90 s", "2 h".
_DURATION = re.compile(r"\b\d+(\.\d+)?\s*(h|hours?|min|minutes?)(\s+\d+\s*s)?\b|\b\d+(\.\d+)?\s*(s|seconds?)\b")


def dates_in(text: str) -> list[str]:
    return [m.group(0) for pattern in _DATES for m in re.finditer(pattern, text)]


def test_readme_names_no_date():
    """The front page says what to expect, not when it was measured: the history of the times is
    docs/development.md's."""
    assert dates_in(README) == []


def test_the_date_check_sees_every_shape_of_a_date():
    for dated in ["run on 2026-12-06", "on 2026/12/06", "12/06/2026", "on 6.12.2026", "Dec 6", "Dec. 6",
                  "6 Dec", "6th of December", "December 2026", "in December", "Sept 30", "May 3", "in 2026",
                  "on Saturday", "measured this morning", "yesterday", "late that afternoon",
                  "earlier that day"]:
        assert dates_in(dated), dated
    for undated in ["port 8080", "vLLM 0.8.5", "2048 tokens", "it may decode", "we march on", "25 min",
                    "Decode the May", "1.2.3", "step-120"]:
        assert dates_in(undated) == [], undated


def test_readme_gives_each_command_one_time():
    block = README.split("<!-- times: measured by the lead -->\n", 1)[1].split("\n\n", 1)[0]
    lines = block.splitlines()
    assert [line.split("`")[1] for line in lines] == ["./scripts/demo.sh", "./scripts/test.sh"]
    for line in lines:
        assert len(_DURATION.findall(line)) == 1, line
    assert len(_DURATION.findall("1 min 46 s")) == 1 and len(_DURATION.findall("24 min, warm 22 min")) == 2


def test_every_readme_link_resolves():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if target.startswith("http"):
            continue
        assert (REPO_ROOT / target).exists(), target


def test_the_quickstart_is_the_demos_script_as_written():
    demo = load_demo()
    commands = demo.readme_quickstart(README)
    assert len(commands) <= 10
    qs = demo.Quickstart(demo.StoryConfig(), commands)
    # with the demo's defaults, each command runs exactly as the README writes it
    assert sorted(qs.commands.values()) == sorted(commands)
    for command in commands:
        assert command in README, command
    # only the port-forward is not run (the demo's gateway is on the node's network)
    assert [p for p, step in demo.QUICKSTART_STEPS.items() if step is None] == ["kubectl port-forward "]
    # the story says which README command each step runs, and that every one was run
    source = (REPO_ROOT / "scripts" / "demo_cluster.py").read_text()
    for prefix, step in demo.QUICKSTART_STEPS.items():
        if step is not None and prefix not in ("KEY=", "ADMIN="):
            assert f'quickstart.run("{prefix}"' in source, prefix
    assert "quickstart.value(var," in source


def test_the_quickstart_follows_a_test_runs_own_names():
    demo = load_demo()
    cfg = demo.StoryConfig(namespace="demo-x1", operator_namespace="demo-ops-x1", release="so-x1")
    qs = demo.Quickstart(cfg, demo.readme_quickstart(README))
    assert qs.command("helm install ") == "helm install so-x1 charts/sampler-operator -n demo-ops-x1 --create-namespace"
    assert qs.command("kubectl apply ") == "kubectl apply -n demo-x1 -f pool.yaml"
    assert "sampler-demo" not in " ".join(qs.commands.values())


def test_a_readme_command_the_demo_cannot_run_is_refused():
    demo = load_demo()
    commands = demo.readme_quickstart(README)
    with pytest.raises(ValueError, match="does not know"):
        demo.Quickstart(demo.StoryConfig(), [*commands, "kubectl delete -n sampler-demo sp demo"])
    with pytest.raises(ValueError, match="missing"):
        demo.Quickstart(demo.StoryConfig(), [c for c in commands if not c.startswith("curl ")])
    qs = demo.Quickstart(demo.StoryConfig(), commands)
    qs.ran = {"helm install "}
    with pytest.raises(RuntimeError, match="did not run"):
        qs.check_all_run()


def test_the_key_lines_run_in_bash_as_written(tmp_path):
    """The README's `KEY=$(kubectl ... | base64 -d)` lines, run the demo's way, against a stand-in kubectl
    that answers what the API server would (the Secret's field, base64)."""
    demo = load_demo()
    fake = tmp_path / "kubectl"
    fake.write_text('#!/bin/bash\ncase "$*" in\n  *admin-api-key*) printf %s YWRtaW4tMQ== ;;\n'
                    '  *api-key*) printf %s a2V5LTE= ;;\nesac\n')
    fake.chmod(0o755)
    qs = demo.Quickstart(demo.StoryConfig(), demo.readme_quickstart(README))
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    assert (qs.value("KEY", env), qs.value("ADMIN", env)) == ("key-1", "admin-1")
    fake.write_text("#!/bin/bash\necho 'secrets \"demo-sampler-keys\" not found' >&2\nexit 1\n")
    with pytest.raises(RuntimeError, match="not found"):
        qs.value("KEY", env)


def test_helm_install_runs_from_the_repo_with_the_node_tiers_values_added(tmp_path):
    demo = load_demo()
    fake = tmp_path / "helm"
    fake.write_text('#!/bin/bash\n[ -f "$3/Chart.yaml" ] || { echo "no chart at $3" >&2; exit 1; }\necho "$@"\n')
    fake.chmod(0o755)
    qs = demo.Quickstart(demo.StoryConfig(release="so-1", operator_namespace="ops-1"), demo.readme_quickstart(README))
    out = qs.run("helm install ", {"PATH": f"{tmp_path}:/usr/bin:/bin"}, extra=" -f /tmp/values.json")
    assert out.split() == ["install", "so-1", "charts/sampler-operator", "-n", "ops-1", "--create-namespace",
                           "-f", "/tmp/values.json"]
