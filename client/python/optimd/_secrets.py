"""Resume secrets: the daemon gives each session a secret at creation, and
a resume (a restarted trainer, CreateSession(resume=true)) must present it,
so that knowing a job id is not enough to take a session over.

optimd.torch.AdamW keeps each session's secret in a file readable by its
user only, where a restarted trainer of the same user on the same node
finds it by job id and rank:

    $OPTIMD_SECRETS_DIR, else $XDG_RUNTIME_DIR/optimd-secrets, else
    ~/.cache/optimd/secrets;  file <job id, made filesystem-safe>-<hash>.rank<r>

A trainer restarted elsewhere passes `resume_secret=` (the old optimizer's
`opt.resume_secret`, carried by the job's launcher). The file goes when
the session is closed.
"""
import hashlib
import os
import re


def directory():
    d = os.environ.get("OPTIMD_SECRETS_DIR")
    if not d:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        d = os.path.join(runtime, "optimd-secrets") if runtime else \
            os.path.join(os.path.expanduser("~"), ".cache", "optimd",
                         "secrets")
    return d


def path(job_id, rank):
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", job_id)[:48]
    digest = hashlib.sha256(job_id.encode()).hexdigest()[:12]
    return os.path.join(directory(), "%s-%s.rank%d" % (safe, digest, rank))


def load(job_id, rank):
    """The stored secret, or "" when there is none."""
    try:
        with open(path(job_id, rank)) as f:
            return f.read().strip()
    except OSError:
        return ""


def store(job_id, rank, secret):
    """Writes the secret (mode 0600, in a 0700 directory), atomically."""
    d = directory()
    os.makedirs(d, mode=0o700, exist_ok=True)
    final = path(job_id, rank)
    tmp = "%s.tmp%d" % (final, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                 0o600)
    try:
        os.write(fd, secret.encode())
    finally:
        os.close(fd)
    os.replace(tmp, final)


def remove(job_id, rank):
    try:
        os.unlink(path(job_id, rank))
    except OSError:
        pass
