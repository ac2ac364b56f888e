"""The store on PostgreSQL with pgvector (HYATLAS_STORE_DSN): the same rooms as the SQLite
store, over a database that several store replicas may share."""
