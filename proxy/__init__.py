"""kvkeeper service: aiohttp proxy, hint dialects, Redis session plane, admin API, CLI."""
