"""The front door: `token-proxy` (`main`): flags and TOKEN_PROXY_* variables -> Settings -> the server.

`main.py` parses and starts, `flags.py` is the flag table (FLAG_GROUPS), `start.py` the steps before serving
(the port, the simulator), `healthcheck.py` the container's HEALTHCHECK (`python -m token_proxy.cli.healthcheck`).
"""

from token_proxy.cli.flags import FLAG_GROUPS
from token_proxy.cli.main import (
    known_variables,
    main,
    normalise_backend_url,
    parse_settings,
    read_chat_template,
)
from token_proxy.cli.start import StartupError

__all__ = ["FLAG_GROUPS", "StartupError", "known_variables", "main", "normalise_backend_url", "parse_settings",
           "read_chat_template"]
