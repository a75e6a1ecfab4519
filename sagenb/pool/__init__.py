"""The engine pool: ipyparallel engines started, attached to, kept warm and watched."""
