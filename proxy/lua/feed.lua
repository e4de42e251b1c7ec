-- The change feed of protected sessions, read incrementally by the retention workers.
-- Every script that changes what retention reads of a protected session adds its deadline
-- member to the feed ZSET scored by a sequence number (INCR), so a reader asks only for what
-- changed after the last sequence it saw: the work of a tick follows the changes, never the
-- number of idle protected sessions. The feed is trimmed to its newest ARGV[3] members; the
-- highest trimmed score is kept, so a reader that fell behind it knows to read everything.
-- KEYS[1] feed ZSET  KEYS[2] feed sequence  KEYS[3] trim floor
-- ARGV[1] after (exclusive sequence)  ARGV[2] limit  ARGV[3] max feed length  ARGV[4] key prefix
-- ARGV[5] "1": tenants are hash tags in key names (a cluster)  ARGV[6..] session fields
-- Returns {sequence now, trim floor, then per changed session: member, score, fields...}
-- (fields nil when the session is gone).
local trim = tonumber(ARGV[3])
local excess = redis.call('ZCARD', KEYS[1]) - trim
if excess > 0 then
  local last = redis.call('ZRANGE', KEYS[1], excess - 1, excess - 1, 'WITHSCORES')
  redis.call('SET', KEYS[3], last[2])
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
end
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
local out = {tonumber(redis.call('GET', KEYS[2]) or '0'), tonumber(redis.call('GET', KEYS[3]) or '0')}
local rows = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf', 'WITHSCORES', 'LIMIT', 0, ARGV[2])
for i = 1, #rows, 2 do
  local member = rows[i]
  local sep = string.find(member, '\31', 1, true)
  if sep then
    local tenant, sid = string.sub(member, 1, sep - 1), string.sub(member, sep + 1)
    local t = ARGV[5] == '1' and ('{' .. tenant .. '}') or tenant
    local values = redis.call('HMGET', ARGV[4] .. ':s:' .. t .. ':' .. sid, unpack(fields))
    out[#out + 1] = member
    out[#out + 1] = tonumber(rows[i + 1])
    for j = 1, #fields do out[#out + 1] = values[j] end
  end
end
return out
