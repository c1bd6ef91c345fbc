"""The one request pipeline every endpoint runs through."""
