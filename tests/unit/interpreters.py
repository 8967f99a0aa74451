"""Fresh Python interpreters for the tests that start several: run together, so that their
start-up (torch's and deepspeed's imports, several seconds each on 2 CPU cores) overlaps."""
import subprocess
from typing import Dict, List, Optional, Sequence, Tuple

Run = Tuple[Sequence[str], Optional[Dict[str, str]]]  # (argv, environment; None: this one's)


def run_together(runs: Sequence[Run], timeout: float) -> List[subprocess.CompletedProcess]:
    """Each run's outcome, in order; each is waited on for at most ``timeout`` seconds in turn,
    and where one fails to start or raises, those not read yet are killed and read."""
    started: List[subprocess.Popen] = []
    done: List[subprocess.CompletedProcess] = []
    try:
        for argv, env in runs:
            started.append(subprocess.Popen(list(argv), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True))
        for process, (argv, _) in zip(started, runs):
            stdout, stderr = process.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(list(argv), process.returncode, stdout, stderr))
        return done
    finally:
        for process in started[len(done):]:  # those not read: killed if running, their pipes closed
            if process.poll() is None:
                process.kill()
            process.communicate()
