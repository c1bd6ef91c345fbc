"""The console's pages, each a handler of (state, request, session), one module per page.

Every read and change goes through the gateway's own API with the session's key
(gateway/console/api.py), so a team key sees exactly what the API shows it — its own team —
and the admin key everything.
"""
