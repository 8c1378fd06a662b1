"""The edgeq custom-op domain's name and version, in a module of their own so that op modules and
the schema table can both import them without importing each other."""

DOMAIN = "edgeq"
DOMAIN_VERSION = 1
