"""A model's chat template rendered once at load in a box: a child process with a time budget, an address-space
limit and an output-size budget, running transformers' own template code (the sandboxed jinja environment every
request's prompt is rendered in). A template past any budget is refused by name before the model serves.

Why a process: a template is code from the model file. Jinja's sandbox stops attribute tricks, not work: nested
`range(99999)` loops ran for ever inside configure (the lifecycle service blocked until SIGKILL), and a template
rendering 20 MB asked for 92 GB. Neither can be stopped inside this process (a Python thread cannot be killed, and
counting in jinja's hooks misses string growth); a child can be killed at its deadline and cannot take more memory
than its limit. It costs one interpreter with transformers' template module (seconds), once per template: rendered
from the file's header before its conversion, and remembered in the cache folder.
"""
from __future__ import annotations

import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time

from . import tool_call_formats
from .cache_records import read_records, update_record

TEMPLATE_SECONDS = 5.0  # a render of the probe conversations, the child's start aside
TEMPLATE_MAX_CHARS = 1 << 20  # what the probes may render (a prompt's worth of text at most)
TEMPLATE_MEMORY = 1 << 29  # bytes the child may add to its address space once started
START_SECONDS = 60.0  # the child's interpreter and imports (a loaded machine)

# Conversations as the engine renders them (chat_prompts.chat_ids): a question, and a system message with turns
PROBES = ([{"role": "user", "content": "What is the capital of France?"}],
          [{"role": "system", "content": "You are a helpful robot assistant.\n\nThe kitchen is on the left."},
           {"role": "user", "content": "Where is the kitchen?"},
           {"role": "assistant", "content": "On the left."},
           {"role": "user", "content": "And the door?"}])
# ... and with a tool, as the node's tools render (model/tool_call_formats.detect, chat_prompts.chat_ids), and a
# tool's result given back in each role tool_call_formats.traits tries
TOOL_PROBES = ((tool_call_formats.PROBE_CONVERSATION, [tool_call_formats.PROBE_TOOL]),
               *((tool_call_formats.result_probe(role), [tool_call_formats.PROBE_TOOL])
                 for role in ("user", *tool_call_formats.RESULT_ROLES)))

_CHILD = r"""
import json, resource, sys
from transformers.utils.chat_template_utils import render_jinja_template
def vm():
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
sys.stdout.write("ready\n"); sys.stdout.flush()
job = json.loads(sys.stdin.readline())
now = vm()
if now is not None:
    resource.setrlimit(resource.RLIMIT_AS, (now + job["memory"], now + job["memory"]))
sizes = []
for conv, tools in [(c, None) for c in job["probes"]] + job["tool_probes"]:
    try:
        text = render_jinja_template(conversations=[conv], tools=tools, chat_template=job["template"],
                                     add_generation_prompt=True, **job["tokens"])[0][0]
    except MemoryError:
        print(json.dumps({"memory": True})); sys.exit(0)
    except Exception as e:  # the template's own refusal (a role it does not take): not a budget, said at requests
        sizes.append(-1)
        continue
    if len(text) > job["chars"]:
        print(json.dumps({"chars": len(text)})); sys.exit(0)
    sizes.append(len(text))
print(json.dumps({"sizes": sizes}))
"""

CHECKED_FILE = "chat_templates.json"  # templates (by text and budgets) rendered within budget
_CHECKED: set[str] = set()  # ... by this process


class TemplateError(ValueError):
    """The chat template went past a budget."""


def _templates(tokenizer) -> dict[str, str]:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, str):
        return {"default": t}
    if isinstance(t, dict):
        return {str(k): v for k, v in t.items() if isinstance(v, str)}
    return {}


def _tokens(tokenizer) -> dict[str, str]:
    """The special tokens transformers passes a template (bos_token, eos_token, ...), as strings."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        v = getattr(tokenizer, name, None)
        if isinstance(v, str):
            out[name] = v
    return out


def check(tokenizer, name: str, record_dir: str | None = None) -> None:
    """check_template for each of a loaded tokenizer's chat templates, with its special tokens."""
    for which, template in _templates(tokenizer).items():
        check_template(template, name, record_dir, _tokens(tokenizer), which)


def check_template(template: str, name: str, record_dir: str | None = None, tokens: dict | None = None,
                   which: str = "default", seconds: float = TEMPLATE_SECONDS) -> None:
    """Renders `template` on PROBES and TOOL_PROBES in a child process; TemplateError naming it (`name`: the model)
    where it takes longer than `seconds`, more memory than TEMPLATE_MEMORY or renders more than TEMPLATE_MAX_CHARS
    characters.
    Never waits longer than START_SECONDS + `seconds`. A template within budget is remembered (this process, and
    CHECKED_FILE in `record_dir`) by its text and the budgets: the next load does not render it again."""
    job = {"template": template, "tokens": tokens or {}, "probes": PROBES, "tool_probes": TOOL_PROBES,
           "chars": TEMPLATE_MAX_CHARS, "memory": TEMPLATE_MEMORY}
    key = hashlib.sha256(json.dumps([template, PROBES, TOOL_PROBES, TEMPLATE_MAX_CHARS, TEMPLATE_MEMORY,
                                     seconds]).encode()).hexdigest()[:32]
    store = os.path.join(record_dir, CHECKED_FILE) if record_dir else None
    if store and read_records(store).get(key) is True:
        return
    if key not in _CHECKED:
        label = f"the chat template{'' if which == 'default' else f' {which!r}'} of model '{name}'"
        _render(job, seconds, label)
        _CHECKED.add(key)
    if store:
        try:
            update_record(store, key, True, keep=256)
        except OSError:
            pass


def _render(job: dict, seconds: float, label: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    assert proc.stdin is not None  # PIPE
    try:
        if _line(proc, START_SECONDS) != "ready":
            raise TemplateError(f"{label} could not be checked: its renderer did not start "
                                f"(exit {proc.poll()})")
        proc.stdin.write((json.dumps(job) + "\n").encode())
        proc.stdin.flush()
        got = _line(proc, seconds)
        if got is None:
            raise TemplateError(f"{label} is refused: rendering three short conversations took more than {seconds:g} "
                                "s (a template that loops without end, or nearly)")
        try:
            result = json.loads(got)
        except ValueError:
            result = {}
        if result.get("memory") or (not result and proc.wait(5) != 0):
            raise TemplateError(f"{label} is refused: rendering three short conversations needed more than "
                                f"{TEMPLATE_MEMORY >> 20} MB")
        if "chars" in result:
            raise TemplateError(f"{label} is refused: it renders {result['chars']} characters for two short "
                                f"conversations (at most {TEMPLATE_MAX_CHARS})")
        if "sizes" not in result:
            raise TemplateError(f"{label} could not be checked (its renderer said {got[:200]!r})")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass


def _line(proc: subprocess.Popen, seconds: float) -> str | None:
    """The child's next line of output (at most 64 KB), or None once `seconds` pass without one."""
    deadline = time.monotonic() + seconds
    buf = b""
    out = proc.stdout
    assert out is not None  # PIPE
    with selectors.DefaultSelector() as sel:
        sel.register(out, selectors.EVENT_READ)
        while b"\n" not in buf and len(buf) < 1 << 16:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                return None
            chunk = os.read(out.fileno(), 1 << 16)
            if not chunk:
                break
            buf += chunk
    return buf.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
