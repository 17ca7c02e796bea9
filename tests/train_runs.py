"""Running ``python -m flax_models.train`` in-process for the tests."""
import contextlib
import io
import re

from flax_models import train


def run_main(argv):
    """``(result, stdout)`` of ``flax_models.train.main(argv)``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = train.main(argv)
    return result, out.getvalue()


def printed_losses(out: str, steps: int, impl: str = "ls2"):
    """The loss figures of ``impl``'s step lines (``"<impl> step i/steps | loss x"``)."""
    return re.findall(rf"^{impl} step \d+/{steps} \| loss (\d+\.\d{{4}})", out, re.M)
