"""The service's ground floor: what every other part stands on and that imports none of
them: the settings (:mod:`.settings`, :mod:`.settings_sources`), the HTTP errors in
OpenAI's shape (:mod:`.errors`), the sampling ranges (:mod:`.ranges`), the local token
and the bearer guards (:mod:`.token`, :mod:`.auth`), the allowed origins and hosts
(:mod:`.origins`), the user folders (:mod:`.paths`), the version and the shipped files
(:mod:`.version`, :mod:`.resources`)."""
