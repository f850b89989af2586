"""``jaxdecode explore``: ``serve`` with the decoding explorer's page opened in a browser
(``docs/server.md``)."""

from __future__ import annotations

import socket
import threading


def add_explore(sub) -> None:
    """Register ``explore``: ``serve``'s options, then the page opened in a browser once the server
    listens (on a free port unless ``--port`` is given)."""
    from jaxdecode.cli.server import add_serve

    class Named:  # add_serve registers its parser, with every option of serve's, under this name
        def add_parser(self, name, **kw):
            return sub.add_parser("explore", help="the decoding explorer: serve the model and open its page "
                                                   "in a browser (serve's options)",
                                  description="'jaxdecode serve' with the explorer's page, http://HOST:PORT/, "
                                              "opened in a browser; the port defaults to a free one.")

    add_serve(Named())
    sub.choices["explore"].set_defaults(func=cmd_explore, port=None)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def cmd_explore(args):
    from jaxdecode.cli.server import cmd_serve

    if args.port is None:
        args.port = _free_port(args.host)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    threading.Thread(target=_open_when_up, args=(f"http://{host}:{args.port}/",), daemon=True).start()
    return cmd_serve(args)


def _open_when_up(url: str, timeout: float = 600.0) -> None:
    """Open ``url`` in the user's browser once the server answers (nothing fails without a browser)."""
    import time
    import urllib.request
    import webbrowser

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "health", timeout=2):
                break
        except OSError:
            time.sleep(0.5)
    else:
        return
    print(f"jaxdecode: the explorer is at {url}", flush=True)
    try:
        webbrowser.open(url)
    except webbrowser.Error:
        pass
