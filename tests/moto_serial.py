"""moto's S3 server with one request at a time: ``python tests/moto_serial.py PORT``.

moto checks ``If-None-Match: *`` and then stores the object as two steps (``moto/s3/responses.py``, ``put_object``),
and its own server (``python -m moto.server``) runs each request on a thread of its own. Two conditional writes of one
key that arrive together can then both pass the check and both succeed, which S3 never lets happen; under CI's load
the mirror's lease test saw it (2026-12-02). Requests taken one at a time make moto's create-if-absent atomic, as
S3's is. Nothing here imports trl_ext.
"""

import sys
import threading

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


def one_at_a_time(app):
    """``app`` with each request handled whole (its response body included) before the next one starts."""
    lock = threading.Lock()

    def serial(environ, start_response):
        with lock:
            return list(app(environ, start_response))

    return serial


if __name__ == "__main__":
    app = DomainDispatcherApplication(create_backend_app)
    # threaded, so that a client's kept-alive connection does not hold back the others; the lock orders the requests
    run_simple("127.0.0.1", int(sys.argv[1]), one_at_a_time(app), threaded=True, request_handler=MotoRequestHandler)
