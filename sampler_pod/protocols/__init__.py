"""Client protocols mapped onto the one sampling core: Tinker (`/api/v1`) and Twinkle."""
