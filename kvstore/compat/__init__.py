"""Drop-in clients with other stores' APIs over Crescent (kvstore/compat/mooncake.py: Mooncake Store)."""
