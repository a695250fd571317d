"""The API process's HTTP and websocket layer, in three parts:

- protocol.py: what clients send (request bodies, websocket frames), as pydantic models;
- serving/: what a request does: request building, session leases, answers, appends;
- routers/: the routes, which parse a request and hand it to serving.

errors.py maps every failure to one error schema; admission.py admits or refuses each HTTP
request before routing; deps.py holds the app's shared state and authentication.
"""
