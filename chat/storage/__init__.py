"""What the server keeps: signed-in people's records (SQLite or PostgreSQL), the server's chats by keys it made, and share links."""
